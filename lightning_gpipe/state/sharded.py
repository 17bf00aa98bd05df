"""Sharded checkpoints: every stage writes and reads its own shard with ``torch.distributed.checkpoint``.

Keys are the user's parameter names, so a directory written by K stages loads into any number of
stages. Lightning's other checkpoint entries (loops, callbacks, hyperparameters) go to
:data:`META_FILE`, written by rank 0. A parameter tied across stages (GPT-2's head and embedding) has
its optimizer state under its first name in the model (``embed.tok.weight``), on every stage holding a
copy (``aliases``), so the state does not depend on which stage saved it, or whether the model was
whole then (after ``fit``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_gpipe.errors import CheckpointError
from lightning_gpipe.state import atomic
from lightning_gpipe.state.check import Shapes, check_state_fits, shapes
from lightning_gpipe.state.loading import load_structure
from lightning_gpipe.state.safe_planner import SafeLoadPlanner
from lightning_gpipe.state.safe_reader import METADATA_FILE, SafeReader

__all__ = [
    "META_FILE",
    "SHARDED_KEY",
    "is_complete",
    "is_sharded",
    "load_sharded",
    "save_sharded",
    "set_sharded_optimizer_states",
]

META_FILE = "lightning_meta.pt"


def _flat_options() -> Any:
    """Optimizer states flattened to one key per parameter and field, so shards can be regrouped."""
    return StateDictOptions(flatten_optimizer_state_dict=True)


_FLAT = _flat_options()
SHARDED_KEY = "gpipe_sharded"


def _renamed(flat: dict[str, Any], aliases: Mapping[str, str | None]) -> dict[str, Any]:
    """A flattened optimizer state (``state.<name>.<key>``, ``param_groups.<name>.<key>``) with each
    ``name`` in ``aliases`` replaced by its value (``None``: kept)."""
    heads = {
        f"{part}.{name}.": f"{part}.{other}."
        for name, other in aliases.items()
        if other and other != name
        for part in ("state", "param_groups")
    }
    if not heads:
        return flat
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head = next((h for h in heads if key.startswith(h)), None)
        out[heads[head] + key[len(head) :] if head is not None else key] = value
    return out


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    aliases: Mapping[str, str | None] | None = None,
) -> None:
    """Write a checkpoint directory: every stage its own shard, no gather to one process.

    Model and optimizer tensors go through ``torch.distributed.checkpoint`` (keys are the
    user's parameter names, so any number of stages can load them); the rest of Lightning's
    checkpoint (loops, callbacks, hyperparameters) goes to ``lightning_meta.pt``, written by
    rank 0 last. All ranks must call this (one process may, without process groups). The
    directory appears atomically: everything is written to ``<path>.tmp-<id>`` beside it and
    committed by renames (:func:`lightning_gpipe.state.atomic.commit`), so a crash at any point
    leaves the previous checkpoint loadable; copies an interrupted save left are removed. ``aliases``:
    this stage's names of tied copies → the name their optimizer state is saved under.

    Raises:
        RuntimeError: rank 0 failed to write or commit (its own error on rank 0).
    """
    path = Path(path)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    staged = [atomic.staging(path)]  # one name on every rank
    if distributed:
        dist.broadcast_object_list(staged, src=0)
    state = {
        "model": {k: v for k, v in module.state_dict().items()},
        "optimizers": [
            _renamed(get_optimizer_state_dict(module, o, options=_FLAT), aliases or {}) for o in optimizers
        ],
    }
    dcp.save(state, checkpoint_id=str(staged[0]))
    error: BaseException | None = None
    if rank == 0:
        try:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta[SHARDED_KEY] = True
            atomic.write_file(staged[0] / META_FILE, lambda target: torch.save(meta, target))
            atomic.commit(staged[0], path)
        except Exception as err:  # every rank must learn of it, or they would wait forever
            error = err
    ok = [error is None]
    if distributed:
        dist.broadcast_object_list(ok, src=0)
    if error is not None:
        raise error
    if not ok[0]:
        raise RuntimeError(
            f"rank 0 failed to write the checkpoint {path}; see its error (the previous one is intact)"
        )


def is_sharded(path: str | os.PathLike) -> bool:
    """``path`` is a directory (a sharded checkpoint, complete or not)."""
    return Path(path).is_dir()


def is_complete(path: str | os.PathLike) -> bool:
    """``path`` is a complete sharded checkpoint (its metadata and ``lightning_meta.pt``, written last)."""
    return (Path(path) / META_FILE).is_file() and (Path(path) / METADATA_FILE).is_file()


def load_sharded(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    weights_only: bool | None = None,
    expected: Shapes | None = None,
    strict: bool = True,
    aliases: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """Read a checkpoint directory into this rank's stage (any stage count): a Lightning checkpoint dict.

    ``state_dict`` holds this stage's tensors; ``optimizer_states`` holds each optimizer's state
    keyed by parameter name (``torch.distributed.checkpoint.state_dict`` format). Every file is
    read with an allow-list unless ``weights_only=False`` (:class:`.safe_reader.SafeReader`), and
    the model's keys and shapes are checked against the checkpoint's before any tensor is read.

    Args:
        expected: the whole model's keys and shapes (default: ``module``'s).
        strict: the keys must be equal (:func:`.check.check_state_fits`).
        aliases: this stage's names of tied copies → the name their optimizer state is saved under
            (:func:`save_sharded`); the states come back under this stage's names.

    Raises:
        UnsafeCheckpointError: a file holds objects the safe unpickler refuses (the message names
            the file and the opt-in).
        CheckpointError: the directory is no complete checkpoint, a file is truncated or damaged,
            or the checkpoint does not fit the model (the message names the file).
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        what = "an interrupted save" if (path / METADATA_FILE).is_file() else "not a checkpoint directory"
        raise CheckpointError(f"{path} has no {META_FILE}: {what} (a sharded checkpoint's files are missing)")
    checkpoint = load_structure(path / META_FILE, weights_only, map_location="cpu")
    reader = SafeReader(path, weights_only)
    metadata = reader.read_metadata()
    saved = {
        key.removeprefix("model."): tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    model = expected if expected is not None else shapes(module.state_dict())
    check_state_fits(saved, model, strict, path, type(module).__name__)
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizers:
        flat = [get_optimizer_state_dict(module, opt, options=_FLAT) for opt in optimizers]
        state["optimizers"] = [_renamed(opt, aliases or {}) for opt in flat]
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader, allow_partial_load=not strict))
    except CheckpointException as err:
        raise _failure(err, path) from None
    back = {saved: name for name, saved in (aliases or {}).items() if saved}
    checkpoint["state_dict"] = state["model"]
    checkpoint["optimizer_states"] = [_renamed(opt, back) for opt in state.get("optimizers", [])]
    return checkpoint


def _failure(err: CheckpointException, path: Path) -> Exception:
    """The error to raise for a failed ``dcp.load``: this rank's (else the lowest rank's), named."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    failed = rank if rank in err.failures else min(err.failures)
    cause = err.failures[failed][0]
    if isinstance(cause, CheckpointError):
        return cause
    return CheckpointError(f"{path} cannot be loaded (rank {failed}): {type(cause).__name__}: {cause}")


def set_sharded_optimizer_states(
    module: nn.Module, optimizers: Sequence[Optimizer], states: Sequence[Any]
) -> None:
    for opt, state in zip(optimizers, states):
        set_optimizer_state_dict(module, opt, state, options=_FLAT)
