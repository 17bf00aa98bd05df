"""Full checkpoints: the whole Sequential's state and one merged optimizer state, gathered from
every stage."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gpipe._lightning import distributed_is_initialized, optimizer_to_device
from lightning_gpipe.errors import check_choice
from lightning_gpipe.partition.cut import PLACEHOLDER, key_prefix
from lightning_gpipe.partition.tied import Tied, alias_tied_state
from lightning_gpipe.state.dtensors import full_tensors, shard_like
from lightning_gpipe.state.materialize import has_meta
from lightning_gpipe.state.optimizer import (
    NAMES_KEY,
    drop_placeholder,
    drop_placeholder_names,
    group_names,
    merge_optimizer_states,
    split_optimizer_state,
)
from lightning_gpipe.transport.groups import tensors_to_cpu
from lightning_gpipe.transport.layout import Layout

__all__ = [
    "FORMATS",
    "broadcast_from_first_replica",
    "check_format",
    "gather_sequential_state",
    "load_optimizer_states",
    "merged_optimizer_state",
    "module_state_dict",
    "user_state_dict",
]

_FORMATS = {"full": "one Lightning checkpoint file", "sharded": "one shard per stage, written in parallel"}
FORMATS = tuple(_FORMATS)


def check_format(checkpoint_format: str) -> str:
    """Return ``checkpoint_format`` if it is one of :data:`FORMATS`.

    Raises:
        ValueError: any other value, named, with the two choices.
    """
    return check_choice("checkpoint_format", checkpoint_format, _FORMATS)


def broadcast_from_first_replica(stage: nn.Module, layout: Layout, rank: int, group: Any) -> None:
    """Every copy of a stage takes replica 0's parameters and buffers (as DDP does); ``group``: the
    stage's replicas."""
    if layout.replicas == 1:
        return
    src = layout.rank(0, layout.stage_of(rank), layout.tensor_of(rank))
    with torch.no_grad():
        for tensor in stage.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)


def gather_sequential_state(
    stage: nn.Module, layout: Layout, rank: int, to_all: bool, tied: Sequence[Tied] = ()
) -> dict[str, Tensor]:
    """The pipelined Sequential's full ``state_dict`` (keys relative to it, CPU) from replica 0's stages
    (``DTensor`` entries whole, from tensor-parallel rank 0).

    Every rank must call it. With ``to_all`` every rank receives it; else rank 0 does and the
    others get ``{}``. Every key of a ``tied`` parameter holds one tensor, its owner stage's
    (saved once, as the plain module's shared parameter is).
    """
    local = tensors_to_cpu(full_tensors(stage.state_dict()))  # DTensors whole: every rank calls
    mine = local if layout.replica_of(rank) == 0 and layout.tensor_of(rank) == 0 else {}
    parts: list[Any] = [None] * layout.world_size
    if to_all:
        dist.all_gather_object(parts, mine)
    else:
        dist.gather_object(mine, parts if rank == 0 else None, dst=0)
        if rank != 0:
            return {}
    full: dict[str, Tensor] = {}
    for part in parts:
        full.update(part)
    # in the Sequential's layer order (with virtual stages a stage's layers are not contiguous)
    order = {name: k for k, name in enumerate(getattr(stage, "names", ()))}
    full = dict(sorted(full.items(), key=lambda item: _layer_index(item[0], order)))
    return alias_tied_state(full, tied)


def _layer_index(key: str, order: dict[str, int]) -> int:
    """The index of the layer holding ``key`` (a layer's name may be dotted: a plan's ``blocks.3``)."""
    parts = key.split(".")
    for end in range(1, len(parts)):
        index = order.get(".".join(parts[:end]))
        if index is not None:
            return index
    return len(order)


def user_state_dict(
    module: nn.Module, stage: nn.Module, seq_name: str, layout: Layout, rank: int, tied: Sequence[Tied] = ()
) -> dict[str, Any]:
    """The user's full ``state_dict`` (original parameter names) on rank 0; ``{}`` elsewhere. All
    ranks call it."""
    full = gather_sequential_state(stage, layout, rank, to_all=False, tied=tied)
    if rank != 0:
        return {}
    prefix = key_prefix(seq_name)
    state = {k: v for k, v in module.state_dict().items() if not k.startswith(prefix)}
    state.update({prefix + k: v for k, v in full.items()})
    return state


def module_state_dict(
    module: nn.Module,
    stage: nn.Module | None,
    seq_name: str | None,
    layout: Layout,
    rank: int,
    arrive: Callable[[str], None],
    tied: Sequence[Tied] = (),
) -> dict[str, Any]:
    """The model's full ``state_dict`` (original parameter names) for a checkpoint: on rank 0, gathered from
    every stage of ``stage`` (installed as ``seq_name``) after ``arrive(operation)``, each tied parameter once
    (``tied``, :func:`user_state_dict`); the module's own without a stage.

    Raises:
        RuntimeError: without a stage, the module holds meta tensors (built on the meta device, one
            stage per rank).
    """
    if stage is None and has_meta(module):
        raise RuntimeError(
            f"{type(module).__name__} was built on the meta device and each rank holds only its own "
            "stage outside fit/validate/test; save checkpoints while the trainer runs (ModelCheckpoint, or "
            "trainer.save_checkpoint from a callback)"
        )
    if stage is None or seq_name is None or not distributed_is_initialized():
        return module.state_dict()
    arrive("gathering the model's state (save_checkpoint)")
    return user_state_dict(module, stage, seq_name, layout, rank, tied)


def _names_by_id(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def merged_optimizer_state(
    optimizer: Optimizer,
    module: nn.Module,
    layout: Layout,
    rank: int,
    order: Sequence[str] | None = None,
    tied_aliases: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """On rank 0: one optimizer ``state_dict`` over the whole model, merged from replica 0's stages
    (``DTensor`` states whole, from tensor-parallel rank 0).

    It has the layout a single optimizer over the plain module's parameters would have (see
    :mod:`lightning_gpipe.state.optimizer`), plus the parameter names, so it loads back into any
    number of stages. Every rank takes part; ranks other than 0 get ``{}``.

    Args:
        order: every parameter name of the whole model in model order (groups and parameters are
            merged in it).
        tied_aliases: this stage's names of tied parameters
            (:func:`lightning_gpipe.partition.tied.canonical_name`, with the model's prefix); a copy
            the stage does not own (a name mapped to its owner's) is left out, so the parameter
            appears once, where the plain module lists it.
    """
    copies = {k for k, v in (tied_aliases or {}).items() if v is not None}
    names = group_names(optimizer, _names_by_id(module), missing=PLACEHOLDER)
    names = [[PLACEHOLDER if n in copies else n for n in group] for group in names]  # dropped below
    mine = (layout.stage_of(rank), tensors_to_cpu(full_tensors(optimizer.state_dict())), names)
    parts: list[Any] = [mine]
    if distributed_is_initialized() and layout.world_size > 1:
        parts = [None] * layout.world_size
        dist.gather_object(
            mine if layout.replica_of(rank) == 0 and layout.tensor_of(rank) == 0 else None,
            parts if rank == 0 else None,
            dst=0,
        )
        if rank != 0:
            return {}
    stages = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    seen: set[str] = set()
    for _, _, stage_names in stages:  # a tied copy named as its owner (after fit, the module is whole): once
        for group in stage_names:
            group[:] = [PLACEHOLDER if n in seen else n for n in group]
            seen.update(group)
    return merge_optimizer_states(
        [(drop_placeholder(sd, n), drop_placeholder_names(n)) for _, sd, n in stages], order
    )


def load_optimizer_states(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    merged_states: Sequence[Any],
    plain_names: list[str] | None,
    device: torch.device,
    tied_aliases: Mapping[str, str | None] | None = None,
    read: Callable[[Any], Any] | None = None,
) -> None:
    """Give each stage's optimizer its part of the merged optimizer states (matched by parameter name).

    Args:
        plain_names: the Sequential's parameter names (with its prefix) in model order, used for a
            plain one-device checkpoint (one group over every parameter, no names); ``None``:
            such checkpoints cannot be loaded.
        tied_aliases: see :func:`merged_optimizer_state`; a tied copy takes its owner's state.
        read: applied to each of this stage's optimizer states before it is loaded (e.g.
            :meth:`lightning_gpipe.state.loading.LazyCheckpoint.materialize`: read from the file only
            the states this stage keeps).

    Raises:
        CheckpointError: a parameter of this stage has no state in the checkpoint, or the group
            structure differs (:func:`lightning_gpipe.state.optimizer.split_optimizer_state`).
    """
    names_by_id = _names_by_id(module)
    for optimizer, merged in zip(optimizers, merged_states):
        if NAMES_KEY not in merged and len(merged.get("param_groups", ())) == 1 and plain_names is not None:
            merged = {**merged, NAMES_KEY: plain_names}  # a plain one-device checkpoint, in model order
        names = group_names(optimizer, names_by_id, missing=PLACEHOLDER)
        names = [[(tied_aliases or {}).get(n) or n for n in group] for group in names]
        local = split_optimizer_state(
            merged, names, stateless=lambda name: PLACEHOLDER in name, local_groups=optimizer.param_groups
        )
        if read is not None:
            local["state"] = {i: read(v) for i, v in local["state"].items()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        local["state"] = {  # a DTensor parameter's states: its shards (tensor parallelism)
            i: {k: shard_like(v, params[i]) for k, v in fields.items()}
            for i, fields in local["state"].items()
        }
        optimizer.load_state_dict(local)
        optimizer_to_device(optimizer, device)
