"""Saved state and ``DTensor``: whole tensors out of a tensor-parallel stage, shards back into it (issue 42,
item 3).

A stage parallelized by the user's plan (:mod:`lightning_gpipe.strategy.tensor_parallel`) holds ``DTensor``
parameters and optimizer states. A full checkpoint holds whole tensors, as one device's does:
:func:`full_tensors` gathers them when saving, and :func:`shard_like` gives each rank its shard of a whole
tensor when loading, with no communication (every rank holds the whole tensor it loads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_tensors", "read_shard_into", "shard_like"]


def full_tensors(obj: Any) -> Any:
    """``obj`` with every ``DTensor`` in its nested dicts, lists and tuples replaced by its whole tensor
    (``DTensor.full_tensor()``: a collective that every rank of the tensor's mesh must call, in the same
    order); other values as they are."""
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def shard_like(value: Any, target: Any) -> Any:
    """``value`` (a whole tensor) as a ``DTensor`` placed as ``target`` is, this rank's shard taken from it
    (``distribute_tensor(..., src_data_rank=None)``: no communication); ``value`` as it is where ``target``
    is no ``DTensor``, ``value`` is one already or still on the meta device (a lazily read checkpoint entry:
    :func:`read_shard_into`), or the shapes differ (the load then says so)."""
    if (
        not isinstance(target, DTensor)
        or not isinstance(value, Tensor)
        or isinstance(value, DTensor)
        or value.is_meta
        or value.shape != target.shape
    ):
        return value
    local = value.to(device=target.to_local().device, dtype=target.dtype)
    return distribute_tensor(local, target.device_mesh, target.placements, src_data_rank=None)


def read_shard_into(
    read_into: Callable[[Tensor, Tensor], None],
    read: Callable[[Tensor], Tensor],
    entry: Tensor,
    target: Tensor,
) -> None:
    """``read_into(entry, target)``, or for a ``DTensor`` target its shard of the whole tensor ``read(entry)``
    (a lazily read checkpoint entry, :class:`lightning_gpipe.state.loading.LazyCheckpoint`)."""
    if isinstance(target, DTensor):
        target.copy_(shard_like(read(entry) if entry.is_meta else entry, target))
    else:
        read_into(entry, target)
