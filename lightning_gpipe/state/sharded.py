"""Sharded checkpoints: every stage writes and reads its own shard with ``torch.distributed.checkpoint``.

Keys are the user's parameter names, so a directory written by K stages loads into any number of
stages. Lightning's other checkpoint entries (loops, callbacks, hyperparameters) go to
:data:`META_FILE`, written by rank 0.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_gpipe.state.loading import load_structure

__all__ = [
    "META_FILE",
    "SHARDED_KEY",
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


def save_sharded(
    checkpoint: dict[str, Any], path: str | os.PathLike, module: nn.Module, optimizers: Sequence[Optimizer]
) -> None:
    """Write a checkpoint directory: every stage its own shard, no gather to one process.

    Model and optimizer tensors go through ``torch.distributed.checkpoint`` (keys are the
    user's parameter names, so any number of stages can load them); the rest of Lightning's
    checkpoint (loops, callbacks, hyperparameters) goes to ``lightning_meta.pt``, written by
    rank 0. All ranks must call this. The directory appears atomically: everything is written
    to ``<path>.tmp`` and renamed when complete, so a crash during the save leaves a previous
    checkpoint at ``path`` intact.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    state = {
        "model": {k: v for k, v in module.state_dict().items()},
        "optimizers": [get_optimizer_state_dict(module, opt, options=_FLAT) for opt in optimizers],
    }
    dcp.save(state, checkpoint_id=str(tmp))
    error: BaseException | None = None
    if rank == 0:
        try:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta[SHARDED_KEY] = True
            torch.save(meta, tmp / META_FILE)
            old = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            if old.exists():
                shutil.rmtree(old)
        except Exception as err:  # every rank must learn of it, or they would wait forever
            error = err
            shutil.rmtree(tmp, ignore_errors=True)
    ok = [error is None]
    dist.broadcast_object_list(ok, src=0)
    if error is not None:
        raise error
    if not ok[0]:
        raise RuntimeError(
            f"rank 0 failed to write the checkpoint {path}; see its error (the previous one is intact)"
        )


def is_sharded(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).exists()


def load_sharded(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Read a checkpoint directory into this rank's stage (any stage count): a Lightning checkpoint dict.

    ``state_dict`` holds this stage's tensors; ``optimizer_states`` holds each optimizer's state
    keyed by parameter name (``torch.distributed.checkpoint.state_dict`` format). The metadata
    file (``lightning_meta.pt``) is read with torch's safe unpickler unless ``weights_only=False``.

    Raises:
        lightning_gpipe.state.loading.UnsafeCheckpointError: the metadata holds objects the safe
            unpickler refuses (the message names the file and the opt-in).
    """

    path = Path(path)
    checkpoint = load_structure(path / META_FILE, weights_only, map_location="cpu")
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizers:
        state["optimizers"] = [get_optimizer_state_dict(module, opt, options=_FLAT) for opt in optimizers]
    dcp.load(state, checkpoint_id=str(path))
    checkpoint["state_dict"] = state["model"]
    checkpoint["optimizer_states"] = state.get("optimizers", [])
    return checkpoint


def set_sharded_optimizer_states(
    module: nn.Module, optimizers: Sequence[Optimizer], states: Sequence[Any]
) -> None:
    for opt, state in zip(optimizers, states):
        set_optimizer_state_dict(module, opt, state, options=_FLAT)
