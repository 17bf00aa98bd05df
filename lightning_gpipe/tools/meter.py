"""Memory meters: tensor bytes held during a training step, and peak RSS.

On a GPU, ``torch.cuda.max_memory_allocated`` answers "how much did this step need?". A CPU has
no such counter, so :class:`TensorMemoryMeter` keeps one: while active, it sees every operator
call (a ``TorchDispatchMode``, so the autograd engine's backward ops too), counts each *newly
allocated* storage (an output whose storage is none of the op's inputs') and drops it when the
storage is freed. Its ``peak`` is the largest number of bytes allocated since it started and
alive at the same time: activations saved for backward, boundary inputs kept by a pipeline
stage, re-materialized activations while a recompute's backward runs, messages received, and
temporaries. Storages that existed before (parameters, gradients accumulated in place,
optimizer state) are not counted.

Why not saved-tensor hooks alone: ``torch.utils.checkpoint`` installs its own hooks inside
re-materialized regions, which shadow outer ones, so outer hooks never see the recomputed
activations nor the inputs a checkpoint keeps; they would report almost nothing under
``checkpoint="always"``. Saved-tensor hooks are still how :func:`lightning_gpipe.balance.
profile_layers` measures each layer's saved bytes for the cost model.
"""

from __future__ import annotations

import resource
import sys
import weakref
from typing import Any

import torch

from lightning_gpipe._compat import TorchDispatchMode, tree_leaves

__all__ = ["TensorMemoryMeter", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class TensorMemoryMeter(TorchDispatchMode):
    """Peak bytes of tensor storages allocated while active and alive at once (CPU or GPU).

    Use as a context manager around a training step; :attr:`peak` and :attr:`live` are bytes.
    Storages allocated while active and freed later (after the meter exits) still leave
    :attr:`live` when freed.

    Example:
        >>> with TensorMemoryMeter() as meter:
        ...     y = torch.ones(1024) * 2  # two 4 KiB storages, both alive
        >>> meter.peak
        8192
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return
        key = id(storage)
        if key in inputs or key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _key(t: torch.Tensor) -> int:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return -1
