"""Gradients across processes: tied copies summed, data-parallel all-reduce, global-norm clipping over
all stages, their sharded data-parallel ranks and their tensor-parallel ranks.

Under sharded data parallelism (``data_parallel="fsdp"``, issue 42 item 2) and tensor parallelism (item 3)
a gradient may be a ``DTensor``. The replicated data-parallel all-reduce averages each rank's local shard
(the same shard on every replica). The global norm is reduced over the stage's *peer* groups (the
data-parallel group under fsdp, the tensor-parallel group when T > 1), then the pipeline: each rank counts
a gradient's local part once per copy, i.e. only where it is rank 0 of every peer dimension the gradient is
replicated over (a ``Replicate`` placement, or a peer dimension outside the DTensor's mesh, or a plain
tensor), so that every element of every whole gradient is counted exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from lightning_gpipe._compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_gpipe.partition.tied import TiedGroups, norm_parameters, sum_tied_gradients
from lightning_gpipe.transport.groups import Groups

BUCKET_BYTES = 25 * 2**20


def local(t: Tensor) -> Tensor:
    """``t``'s local tensor if it is a ``DTensor`` (sharing its storage), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _counted_here(t: Tensor, peers: list[tuple[str, dist.ProcessGroup]]) -> bool:
    """Whether this rank counts ``t``'s local part in the global norm: it is rank 0 of every peer dimension
    ``t`` is replicated over (its ``Replicate`` placements; a dimension outside its mesh)."""
    mesh = t.device_mesh if isinstance(t, DTensor) else None
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    for name, group in peers:
        if name in names:
            assert isinstance(t, DTensor) and mesh is not None
            dim = names.index(name)
            if isinstance(t.placements[dim], Replicate) and mesh.get_local_rank(dim) != 0:
                return False
        elif dist.get_rank(group) != 0:
            return False
    return True


def allreduce_gradients(
    params: Iterable[Tensor], group: object, replicas: int, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Average ``.grad`` of ``params`` over the ``replicas`` ranks of ``group``, in buckets of
    ≤ ``bucket_bytes``.

    Buckets are flattened per dtype and reduced asynchronously, then waited on together. A
    parameter without a gradient takes part as zeros, so every replica posts the same buckets.
    """
    if replicas <= 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))
    buckets: list[list[Tensor]] = []
    size, key = 0, None
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_bytes or g.dtype != key:
            buckets.append([])
            size, key = 0, g.dtype
        buckets[-1].append(g)
        size += nbytes
    pending = []
    for bucket in buckets:
        flat = flatten_dense_tensors(bucket)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        flat.div_(replicas)
        for g, reduced in zip(bucket, unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def global_grad_norm(
    params: Iterable[Tensor],
    norm_type: float,
    group: object,
    device: torch.device,
    peers: list[tuple[str, dist.ProcessGroup]] | None = None,
) -> Tensor:
    """The ``norm_type``-norm of the gradients of all stages of a pipeline (``group``) and of all the stage's
    ``peers``: ``(mesh dimension name, process group)`` for each dimension over which a stage's gradients
    are sharded or replicated (``"data_parallel"`` under fsdp, ``"tensor_parallel"`` when T > 1).

    Each rank reduces the local parts of the gradients it counts (module docstring), then all-reduces
    combine the peers and the stages (sum of ``p``-th powers, or max for ``inf``). Ranks with no gradients
    take part with 0.
    """
    peers = peers or []
    grads = [local(p.grad) for p in params if p.grad is not None and _counted_here(p.grad, peers)]
    grads = [g for g in grads if g.numel()]
    groups = [g for _, g in peers] + [group]
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local_max = (
            torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else torch.zeros(())
        )
        total = local_max.to(device)
        for g in groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=g)
        return total
    powers = (
        torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads])
        .pow(norm_type)
        .sum()
        if grads
        else torch.zeros(())
    )
    total = powers.to(device)
    for g in groups:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=g)
    return total.pow(1.0 / norm_type)


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    norm_type: float,
    group: object,
    device: torch.device,
    counted: Iterable[Tensor] | None = None,
    peers: list[tuple[str, dist.ProcessGroup]] | None = None,
) -> Tensor:
    """Clip gradients by the global norm over all stages, like ``torch.nn.utils.clip_grad_norm_`` on
    one device.

    Args:
        counted: the parameters whose gradients make up this stage's share of the norm (default:
            ``params``); a tied parameter's copy on a stage that does not own it is left out, so
            it counts once (:mod:`lightning_gpipe.partition.tied`). Every one of ``params`` is scaled.
        peers: the stage's sharded or replicated dimensions, as in :func:`global_grad_norm`.

    Returns:
        The total norm before clipping.
    """
    params = list(params)
    total = global_grad_norm(params if counted is None else counted, norm_type, group, device, peers)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def synchronize_gradients(
    params: Iterable[Tensor], tied_groups: TiedGroups | None, group: object, replicas: int
) -> None:
    """Once per optimizer step, after the last backward drain, before clipping and the step: each tied
    parameter's gradient summed over the stages holding it (:mod:`lightning_gpipe.partition.tied`), then every
    gradient of ``params`` averaged over the ``replicas`` data-parallel replicas of ``group``."""
    if tied_groups is not None:
        sum_tied_gradients(tied_groups)
    if replicas > 1:
        allreduce_gradients(params, group, replicas)


def norm_peers(groups: Groups, sharded: bool) -> list[tuple[str, dist.ProcessGroup]]:
    """The stage's peer groups for the global norm (:func:`global_grad_norm`): its data-parallel group when
    the stage is ``sharded`` (fsdp), its tensor-parallel group when it has two ranks or more."""
    peers = []
    if sharded and groups.data is not None and dist.get_world_size(groups.data) > 1:
        peers.append(("data_parallel", groups.data))
    if groups.tensor is not None and dist.get_world_size(groups.tensor) > 1:
        peers.append(("tensor_parallel", groups.tensor))
    return peers


def clip_optimizer_gradients(
    optimizer: Optimizer,
    max_norm: float,
    norm_type: float,
    groups: Groups,
    device: torch.device,
    tied_groups: TiedGroups | None = None,
    stage: int = 0,
    sharded: bool = False,
) -> Tensor:
    """``gradient_clip_algorithm="norm"``: :func:`clip_grad_norm_` over ``optimizer``'s parameters, the norm
    taken over every stage's gradients together (``groups.pipeline``), every shard of a ``sharded`` stage's
    (``groups.data``) and every tensor-parallel rank's (``groups.tensor``), a tied parameter counted once (on
    its owner stage, ``stage`` being this one). Returns the total norm before clipping."""
    params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    counted = norm_parameters(params, tied_groups, stage)
    peers = norm_peers(groups, sharded)
    return clip_grad_norm_(params, float(max_norm), norm_type, groups.pipeline, device, counted, peers)
