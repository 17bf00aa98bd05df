"""Gradients across processes: tied copies summed, data-parallel all-reduce, global-norm clipping over
all stages."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_gpipe._compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_gpipe.partition.tied import TiedGroups, norm_parameters, sum_tied_gradients

BUCKET_BYTES = 25 * 2**20


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
        grads.append(p.grad)
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


def _local(t: Tensor) -> Tensor:
    """``t``'s local shard where it is a ``DTensor`` (a sharded stage's gradient, same storage), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _groups(group: object) -> list[object]:
    return list(group) if isinstance(group, (list, tuple)) else [group]


def global_grad_norm(
    params: Iterable[Tensor], norm_type: float, group: object, device: torch.device
) -> Tensor:
    """The ``norm_type``-norm of the gradients of all stages of a pipeline (``group``).

    Each stage reduces its own gradients, then one all-reduce combines the stages (sum of
    ``p``-th powers, or max for ``inf``). Stages with no gradients take part with 0. ``group`` may
    be a list of groups, reduced over in turn: with sharded stages (``DTensor`` gradients, each
    rank's shard counted) the pipeline's and the stage's data-parallel group, which together
    span every shard of every stage.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = (
            torch.stack([g.detach().abs().max().float() for g in grads if g.numel()]).max()
            if any(g.numel() for g in grads)
            else torch.zeros(())
        )
        total = local.to(device)
        for g in _groups(group):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=g)
        return total
    local = (
        torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads])
        .pow(norm_type)
        .sum()
        if grads
        else torch.zeros(())
    )
    total = local.to(device)
    for g in _groups(group):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=g)
    return total.pow(1.0 / norm_type)


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    norm_type: float,
    group: object,
    device: torch.device,
    counted: Iterable[Tensor] | None = None,
) -> Tensor:
    """Clip gradients by the global norm over all stages, like ``torch.nn.utils.clip_grad_norm_`` on
    one device.

    Args:
        counted: the parameters whose gradients make up this stage's share of the norm (default:
            ``params``); a tied parameter's copy on a stage that does not own it is left out, so
            it counts once (:mod:`lightning_gpipe.partition.tied`). Every one of ``params`` is scaled.

    Returns:
        The total norm before clipping.
    """
    params = list(params)
    total = global_grad_norm(params if counted is None else counted, norm_type, group, device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad.detach()).mul_(coef.to(p.grad.device, p.grad.dtype))
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


def clip_optimizer_gradients(
    optimizer: Optimizer,
    max_norm: float,
    norm_type: float,
    group: object,
    device: torch.device,
    tied_groups: TiedGroups | None = None,
    stage: int = 0,
) -> Tensor:
    """``gradient_clip_algorithm="norm"``: :func:`clip_grad_norm_` over ``optimizer``'s parameters, the norm
    taken over every stage's gradients together (``group``: the pipeline's ranks), a tied parameter counted
    once (on its owner stage, ``stage`` being this one). Returns the total norm before clipping."""
    params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    counted = norm_parameters(params, tied_groups, stage)
    return clip_grad_norm_(params, float(max_norm), norm_type, group, device, counted)
