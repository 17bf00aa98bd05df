"""A tensor-memory meter for the unit tests (a copy of the one in benchmarks/memory.py, which the
product's tests do not import): bytes of tensor storages allocated while active and alive at once.

A ``TorchDispatchMode``: it sees every operator call (the autograd engine's backward ops too),
counts each newly allocated storage (an output whose storage is none of the op's inputs') and drops
it when the storage is freed. Storages that existed before are not counted.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorMemoryMeter"]


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
