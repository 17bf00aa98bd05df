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
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn
from torch.optim import Optimizer

from lightning_gpipe import state
from lightning_gpipe._lightning import distributed_is_initialized, unwrap_optimizer
from lightning_gpipe.partition import cut
from lightning_gpipe.state import atomic, check, loading, sharded
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.layout import Layout

__all__ = [
    "fitting",
    "load",
    "load_model_state",
    "load_optimizer_states",
    "model_state",
    "optimizer_state",
    "pipeline_record",
    "save",
    "whole_model_shapes",
]


def pipeline_record(
    balance: list[int] | None, balance_by: Any, chunks: int, stages: int, virtual_stages: int
) -> dict[str, Any]:
    """What a checkpoint records of the pipeline, under ``checkpoint["gpipe"]``."""
    record = {"balance": balance, "balance_by": balance_by, "chunks": chunks}
    return {**record, "stages": stages, "virtual_stages": virtual_stages}


def save(
    checkpoint_format: str,
    checkpoint: dict[str, Any],
    filepath: Any,
    module: nn.Module,
    optimizers: Sequence[Any],
    checkpoint_io: Any,
    rank: int,
    storage_options: Any = None,
    aliases: dict[str, str | None] | None = None,
) -> bool:
    """Write a checkpoint atomically, beside its path (:mod:`lightning_gpipe.state.atomic`); ``False``: the
    strategy's ``CheckpointIO`` writes it instead.

    ``"sharded"``: every stage writes its shard (:func:`.sharded.save_sharded`), when process groups
    exist (``aliases``: this stage's tied copies' names, :meth:`.Pipelined.tied_aliases`). ``"full"``:
    rank 0 writes the file with ``torch.save`` to ``<path>.tmp-<id>`` and replaces ``path`` with it, when
    the ``CheckpointIO`` is Lightning's default (``TorchCheckpointIO``, whose own atomic save stages in
    ``$TMPDIR`` and so truncates ``path`` first when that is another filesystem), the path local and no
    ``storage_options`` given; a custom ``CheckpointIO`` or a remote path is left to the ``CheckpointIO``.
    """
    if checkpoint_format == "sharded":
        if not distributed_is_initialized():
            return False
        sharded.save_sharded(checkpoint, filepath, module, _unwrapped(optimizers), aliases)
        return True
    if type(checkpoint_io) is not TorchCheckpointIO or storage_options is not None or "://" in str(filepath):
        return False
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
        atomic.write_file(filepath, lambda staged: torch.save(checkpoint, staged))
    return True


def whole_model_shapes(pipelined: Pipelined, module: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """The keys and shapes of the whole model's ``state_dict`` (every stage's, under the user's names), as one
    device holds it; ``module``'s own when it is not partitioned."""
    own = check.shapes(module.state_dict())
    installed = pipelined.installed
    if installed is None or pipelined.stage is None:
        return own
    prefix = cut.key_prefix(installed.name)
    whole = {k: v for k, v in own.items() if not k.startswith(prefix)}
    whole.update({prefix + k: v for k, v in check.shapes(installed.sequential.state_dict()).items()})
    return whole


def _complete(copy: Path) -> bool:
    """``copy`` is a complete checkpoint of either format (a leftover of an interrupted save)."""
    return sharded.is_complete(copy) if copy.is_dir() else zipfile.is_zipfile(copy)


def load(
    path: Any,
    weights_only: bool | None,
    pipelined: Pipelined,
    module: nn.Module | None,
    optimizers: Sequence[Any],
    read: Callable[..., dict[str, Any]],
) -> tuple[dict[str, Any], loading.LazyCheckpoint | None]:
    """Read this rank's part of a checkpoint, with torch's safe unpickler unless ``weights_only=False``.

    ``weights_only`` decides how every file is unpickled, the sharded checkpoint's metadata and entries
    included. A full checkpoint file is read stage by stage
    (:func:`lightning_gpipe.state.loading.stage_part`): the other stages' tensors are never read,
    this stage's are read when loaded. Before that, on every rank, the checkpoint's keys and shapes
    are checked against the whole model's (strictly when ``module.strict_loading``), and its optimizer
    states' parameter counts (:mod:`lightning_gpipe.state.check`). When ``path`` is missing because a
    save was interrupted between its renames, the complete copy beside it is read, with a warning
    (:func:`lightning_gpipe.state.atomic.resolve`). A remote path (``scheme://``) is read by
    ``read(path, weights_only=...)`` (the strategy's ``CheckpointIO``), safely unless opted out.

    Returns:
        The checkpoint, and the full file it reads from lazily (``None`` for any other path).

    Raises:
        UnsafeCheckpointError: the safe unpickler refuses a file (the message names it and the opt-in).
        CheckpointError: the checkpoint is incomplete, truncated, damaged or no checkpoint, or does not
            fit the model (the message names the file and what is wrong).
        FileNotFoundError: nothing is at ``path``.
    """
    if "://" in str(path):
        return read(path, weights_only=loading.safe(weights_only)), None
    path = atomic.resolve(path, _complete)
    strict = bool(getattr(module, "strict_loading", True))
    expected = whole_model_shapes(pipelined, module) if module is not None else None
    if sharded.is_sharded(path):
        assert module is not None
        opts = _unwrapped(optimizers) if fitting(module) else []  # test/validate/predict: weights only
        aliases = pipelined.tied_aliases()
        return sharded.load_sharded(path, module, opts, weights_only, expected, strict, aliases), None
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    lazy = loading.LazyCheckpoint(path, weights_only)
    if module is not None and expected is not None:
        saved = check.shapes(lazy.data["state_dict"])
        check.check_state_fits(saved, expected, strict, path, type(module).__name__)
        check.check_optimizer_counts(lazy.data.get("optimizer_states", []), pipelined.plain_names, path)
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


def fitting(module: nn.Module) -> bool:
    """Whether ``module``'s trainer is fitting (or it has none): only ``fit`` restores optimizer states.

    Under ``validate``, ``test`` or ``predict`` after a ``fit`` the strategy still holds that fit's
    optimizers, over the parameters the stage had then; a tensor-parallel stage has new ones (its plan
    is applied anew), so a sharded checkpoint read for their states fails (``KeyError`` in
    ``get_optimizer_state_dict``). Those runs read the model's weights alone, as Lightning restores them.
    """
    trainer = getattr(module, "_trainer", None)
    return trainer is None or getattr(trainer.state.fn, "value", "fit") == "fit"


def _unwrapped(optimizers: Sequence[Any]) -> list[Optimizer]:
    """The torch optimizers behind Lightning's (``LightningOptimizer``) or plain ones."""
    return [unwrap_optimizer(o) for o in optimizers]
