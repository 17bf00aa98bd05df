"""Tied weights across stages: one parameter used by layers that different stages hold.

GPT-2 ties its input embedding (stage 0) to its LM head (the last stage). Each process holds
its own copy of such a parameter on every stage that uses it (as Megatron-LM's "embedding
group" does):

- the copies start equal: the first holding stage broadcasts its value to the others
  (:func:`broadcast_tied`);
- after the backward drain, each copy's gradient is replaced by the sum over the holding stages
  (:func:`sum_tied_gradients`), before clipping and the optimizer step, so every copy takes the
  same step the single parameter takes on one device; the global gradient norm counts the
  parameter once (:func:`norm_parameters`); under tensor parallelism each tensor-parallel rank has its
  groups, and a copy the plan parallelized is summed whole (issue 42, item 4);
- saved state names it as the plain model does: the full ``state_dict`` holds every key under
  which the plain model lists it, all of them one tensor (:func:`alias_tied_state`), and the
  merged optimizer state holds it once, at its first place in model order
  (:func:`canonical_name`).

A *buffer* shared across stages is refused (:func:`lightning_gpipe.partition.cut.check_tied_parameters`):
a forward that updates it in place on one stage (BatchNorm's running statistics) would leave the
other stage's copy stale, and no gradient sum repairs that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_gpipe._compat import children
from lightning_gpipe.transport.layout import Layout, layer_stages

__all__ = [
    "Tied",
    "TiedGroups",
    "alias_tied_state",
    "broadcast_tied",
    "canonical_name",
    "tied_buffers",
    "find_tied",
    "forget_tied_groups",
    "new_tied_groups",
    "norm_parameters",
    "rebind_tied",
    "sum_tied_gradients",
]


@dataclass(frozen=True)
class Tied:
    """One parameter shared by layers on more than one stage.

    Attributes:
        names: every name under which the plain Sequential's ``state_dict`` lists it (relative to
            the Sequential), in model order; ``names[0]`` is the name ``named_parameters()`` gives.
        stages: the stages holding it, ascending; ``stages[0]`` owns it (its broadcast source,
            the copy counted in norms and saved in the optimizer state).
        name_stage: the stage of each entry of ``names``.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    name_stage: tuple[int, ...]

    def local_name(self, stage: int) -> str:
        """The first of its names on ``stage`` (what that stage's ``named_parameters()`` gives)."""
        return next(n for n, s in zip(self.names, self.name_stage) if s == stage)


def _layer_stage(sequential: nn.Sequential, balance: Sequence[int], stages: int | None) -> dict[str, int]:
    stage_of = layer_stages(balance, stages)
    return {name: stage_of[k] for k, name in enumerate(children(sequential))}


def _shared(named: Iterable[tuple[str, Tensor]], stage_of_layer: dict[str, int]) -> list[Tied]:
    by_id: dict[int, list[tuple[str, int]]] = {}
    for name, tensor in named:
        if tensor is None:
            continue
        by_id.setdefault(id(tensor), []).append((name, _stage_of(name, stage_of_layer)))
    tied = []
    for places in by_id.values():
        stages = sorted({s for _, s in places})
        if len(stages) > 1:
            tied.append(Tied(tuple(n for n, _ in places), tuple(stages), tuple(s for _, s in places)))
    return tied


def _stage_of(name: str, stage_of_layer: dict[str, int]) -> int:
    """The stage of the layer holding ``name`` (a layer's name may be dotted: a plan's ``blocks.3``)."""
    parts = name.split(".")
    return next(
        stage_of_layer[layer]
        for end in range(1, len(parts))
        if (layer := ".".join(parts[:end])) in stage_of_layer
    )


def find_tied(sequential: nn.Sequential, balance: Sequence[int], stages: int | None = None) -> list[Tied]:
    """The parameters of ``sequential`` that layers on different stages of ``balance`` share, in model order.

    ``stages``: the number of stages K when ``balance`` has one entry per part (virtual stages;
    :func:`lightning_gpipe.transport.layout.layer_stages`); default: one entry per stage.
    """
    named = sequential.named_parameters(remove_duplicate=False)
    return _shared(named, _layer_stage(sequential, balance, stages))


def tied_buffers(sequential: nn.Sequential, balance: Sequence[int], stages: int | None = None) -> list[Tied]:
    """The buffers of ``sequential`` that layers on different stages of ``balance`` share, in model order.

    A layer may update a buffer in place during its forward (BatchNorm's running statistics);
    a copy on another stage would not see the update, so training could not equal one device:
    :func:`lightning_gpipe.partition.cut.check_tied_parameters` refuses them.
    """
    named = sequential.named_buffers(remove_duplicate=False)
    return _shared(named, _layer_stage(sequential, balance, stages))


def canonical_name(tied: Sequence[Tied], stage: int) -> dict[str, str | None]:
    """For this ``stage``'s local names of tied parameters: the owner's name, or ``None`` on the owner.

    Keys and values are relative to the Sequential.
    """
    out: dict[str, str | None] = {}
    for t in tied:
        if stage in t.stages:
            out[t.local_name(stage)] = None if stage == t.stages[0] else t.names[0]
    return out


def alias_tied_state(state: dict[str, Tensor], tied: Sequence[Tied], prefix: str = "") -> dict[str, Tensor]:
    """Make every key of each tied parameter in ``state`` (a full Sequential ``state_dict``) one
    tensor, the owner's."""
    for t in tied:
        source = state.get(prefix + t.names[0])
        if source is None:
            continue
        for name in t.names[1:]:
            if prefix + name in state:
                state[prefix + name] = source
    return state


@dataclass
class TiedGroups:
    """This rank's tied parameters with the process group of their holding stages (in its replica)."""

    params: list[tuple[Tied, nn.Parameter, Any, int]]  # (tied, local parameter, group, owner's global rank)

    def copies(self, stage: int) -> set[int]:
        """``id`` of the local parameters this stage does not own (left out of norms)."""
        return {id(p) for t, p, _, _ in self.params if t.stages[0] != stage}


_GROUPS: dict[tuple[Any, ...], Any] = {}


def forget_tied_groups() -> None:
    """Drop the groups :func:`new_tied_groups` made (before the default group is made again)."""
    _GROUPS.clear()


def new_tied_groups(tied: Sequence[Tied], stage_module: nn.Module, layout: Layout, rank: int) -> TiedGroups:
    """Create one process group per tied parameter and replica (every rank calls this, in the same order).

    Groups are made once per default group and rank set, so repeated ``fit`` calls reuse them.
    """
    stage = layout.stage_of(rank)
    local = dict(stage_module.named_parameters())
    params = []
    mine = (layout.replica_of(rank), layout.tensor_of(rank))
    for t in tied:
        for replica, tensor in ((d, k) for d in range(layout.replicas) for k in range(layout.tensors)):
            ranks = [layout.rank(replica, s, tensor) for s in t.stages]
            key = (id(dist.group.WORLD), tuple(ranks))
            if key not in _GROUPS:
                _GROUPS[key] = dist.new_group(sorted(ranks))
            if (replica, tensor) == mine and stage in t.stages:
                params.append((t, local[t.local_name(stage)], _GROUPS[key], ranks[0]))
    return TiedGroups(params)


def broadcast_tied(groups: TiedGroups) -> None:
    """Give every copy the owner stage's value."""
    with torch.no_grad():
        for _, p, group, owner in groups.params:
            dist.broadcast(p.data, src=owner, group=group)


def rebind_tied(groups: TiedGroups, stage_module: nn.Module, stage: int) -> None:
    """Point ``groups`` at ``stage_module``'s (this rank's ``stage``) parameters again, after a
    tensor-parallel plan or FSDP's wrapping replaced the tied layers' parameters by ``DTensor`` ones
    (``parallelize_module`` and ``fully_shard`` register new parameters)."""
    local = dict(stage_module.named_parameters())
    groups.params = [(t, local[t.local_name(stage)], group, owner) for t, _, group, owner in groups.params]


def sum_tied_gradients(groups: TiedGroups) -> None:
    """Replace each copy's ``.grad`` by the sum over the holding stages (a missing one counts as zeros).

    A copy sharded by FSDP alone (a ``DTensor`` over the mesh's ``data_parallel`` dimension) sums its
    local shard: every holding stage's copy has the same shape and is sharded the same way over the
    replicas, so the ranks of one group (one replica) hold the same rows of it. Any other ``DTensor``
    copy (a tensor-parallel plan parallelized its layer) is summed whole: its ``full_tensor()`` (a
    collective of its stage's tensor-parallel ranks), then this rank's shard of the sum, so that the
    holding stages may place it differently (the embedding rowwise, the head colwise, or one of them
    plain); the tied groups are per tensor-parallel rank (:func:`new_tied_groups`)."""
    for _, p, group, _ in groups.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if isinstance(grad, DTensor) and grad.device_mesh.mesh_dim_names != ("data_parallel",):
            whole = grad.full_tensor()
            dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group)
            mesh, placements = grad.device_mesh, grad.placements
            grad.to_local().copy_(distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local())
        else:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)


def norm_parameters(params: Iterable[Tensor], groups: TiedGroups | None, stage: int) -> list[Tensor]:
    """``params`` without the copies this stage does not own: each tied parameter counts once in a
    global norm."""
    copies = groups.copies(stage) if groups is not None else set()
    return [p for p in params if id(p) not in copies]
