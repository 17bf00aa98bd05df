"""What ``GPipeStrategy``'s checkpoint hooks do: save and restore the state of one rank's stage.

Lightning asks a strategy, in this order, for the model's ``state_dict`` and each optimizer's
state (saving), then writes the checkpoint; or reads a checkpoint and loads the model's and the
optimizers' states from it (restoring, after setup: into the partitioned module). With
``checkpoint_format="full"`` the model's and optimizers' states are gathered to rank 0 under the
user's names (:mod:`lightning_gpipe.state`) and Lightning's ``CheckpointIO`` writes one file; a
full file is read back stage by stage, lazily (:mod:`lightning_gpipe.state.loading`): :func:`load`
returns the :class:`~lightning_gpipe.state.loading.LazyCheckpoint` it opened, which the strategy
keeps and hands to :func:`load_model_state` and :func:`load_optimizer_states`. With ``"sharded"``
every stage writes and reads its own shard (:mod:`lightning_gpipe.state.sharded`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_gpipe import state
from lightning_gpipe._lightning import distributed_is_initialized, unwrap_optimizer
from lightning_gpipe.state import loading, sharded
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.layout import Layout

__all__ = [
    "load",
    "load_model_state",
    "load_optimizer_states",
    "model_state",
    "optimizer_state",
    "pipeline_record",
    "save_sharded",
]


def pipeline_record(
    balance: list[int] | None, balance_by: Any, chunks: int, stages: int, virtual_stages: int
) -> dict[str, Any]:
    """What a checkpoint records of the pipeline, under ``checkpoint["gpipe"]``."""
    record = {"balance": balance, "balance_by": balance_by, "chunks": chunks}
    return {**record, "stages": stages, "virtual_stages": virtual_stages}


def save_sharded(
    checkpoint: dict[str, Any], filepath: Any, module: nn.Module, optimizers: Sequence[Any]
) -> bool:
    """Write this stage's shard of a sharded checkpoint; ``False`` (no shard) without process groups."""
    if not distributed_is_initialized():
        return False
    sharded.save_sharded(checkpoint, filepath, module, _unwrapped(optimizers))
    return True


def load(
    path: Any,
    weights_only: bool | None,
    pipelined: Pipelined,
    module: nn.Module | None,
    optimizers: Sequence[Any],
    read: Callable[..., dict[str, Any]],
) -> tuple[dict[str, Any], loading.LazyCheckpoint | None]:
    """Read this rank's part of a checkpoint, with torch's safe unpickler unless ``weights_only=False``.

    ``weights_only`` decides how every file is unpickled, the sharded checkpoint's metadata
    included. A full checkpoint file is read stage by stage
    (:func:`lightning_gpipe.state.loading.stage_part`): the other stages' tensors are never read,
    this stage's are read when loaded. A path that is not a local file is read by
    ``read(path, weights_only=...)`` (the strategy's ``CheckpointIO``), safely unless opted out.

    Returns:
        The checkpoint, and the full file it reads from lazily (``None`` for any other path).

    Raises:
        UnsafeCheckpointError: the safe unpickler refuses the file (the message names it
            and the opt-in).
    """
    if sharded.is_sharded(path):
        assert module is not None
        return sharded.load_sharded(path, module, _unwrapped(optimizers), weights_only), None
    if not os.path.isfile(path):
        return read(path, weights_only=loading.safe(weights_only)), None
    lazy = loading.LazyCheckpoint(path, weights_only)
    owners = pipelined.owners()  # tied copies' states
    return loading.stage_part(lazy, module, pipelined.plain_names, owners), lazy


def model_state(
    checkpoint_format: str,
    pipelined: Pipelined,
    module: nn.Module,
    layout: Layout,
    rank: int,
    arrive: Callable[[str], None],
) -> dict[str, Any]:
    """The user's full ``state_dict`` (original parameter names) on rank 0, gathered from all stages; empty
    under ``checkpoint_format="sharded"`` (each stage writes its own shard in ``save_checkpoint``)."""
    if checkpoint_format == "sharded":
        return {}
    p = pipelined
    return state.module_state_dict(module, p.stage, p.name, layout, rank, arrive, p.tied)


def optimizer_state(
    checkpoint_format: str,
    pipelined: Pipelined,
    optimizer: Optimizer,
    module: nn.Module,
    layout: Layout,
    rank: int,
    arrive: Callable[[str], None],
) -> dict[str, Any]:
    """On rank 0: one optimizer ``state_dict`` over the whole model (:func:`.merged_optimizer_state`); empty
    under ``checkpoint_format="sharded"`` (each stage writes its own shard in ``save_checkpoint``)."""
    if checkpoint_format == "sharded":
        return {}
    optimizer = unwrap_optimizer(optimizer)
    if distributed_is_initialized() and layout.world_size > 1:
        arrive("gathering optimizer states (save_checkpoint)")
    order, aliases = pipelined.plain_names, pipelined.tied_aliases()
    return state.merged_optimizer_state(optimizer, module, layout, rank, order, aliases)


def load_optimizer_states(
    pipelined: Pipelined,
    lazy: loading.LazyCheckpoint | None,
    checkpoint: Any,
    module: nn.Module,
    optimizers: Sequence[Any],
    device: torch.device,
) -> None:
    """Give each stage's optimizer its part of the checkpoint's optimizer states (matched by parameter name);
    ``lazy``: the full file :func:`load` opened, if any."""
    states, optimizers = checkpoint["optimizer_states"], _unwrapped(optimizers)
    if checkpoint.get(sharded.SHARDED_KEY):
        return sharded.set_sharded_optimizer_states(module, optimizers, states)
    state.load_optimizer_states(
        module, optimizers, states, pipelined.plain_names, device,
        tied_aliases=pipelined.tied_aliases(), read=lazy.materialize if lazy is not None else None,
    )  # fmt: skip


def load_model_state(
    pipelined: Pipelined,
    lazy: loading.LazyCheckpoint | None,
    module: nn.Module,
    checkpoint: Any,
    strict: bool = True,
) -> None:
    """Load a full checkpoint into the full or the partitioned module (keeping this stage's keys);
    ``lazy``: the full file :func:`load` opened, if any."""
    partitioned = pipelined.stage is not None
    loading.load_model_state(module, checkpoint["state_dict"], strict, lazy, partitioned)


def _unwrapped(optimizers: Sequence[Any]) -> list[Optimizer]:
    """The torch optimizers behind Lightning's (``LightningOptimizer``) or plain ones."""
    return [unwrap_optimizer(o) for o in optimizers]
