"""Split a mini-batch into micro-batches along dim 0, and join them back.

A batch is a tensor or a tuple of tensors that share their first dimension ``N``. GPipe
(Huang et al. 2019, section 2.2) splits it into ``chunks`` micro-batches; here sizes differ by
at most one when ``N`` is not divisible by ``chunks``, and ``N < chunks`` gives ``N``
micro-batches of one sample each, never an empty one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

Batch = Tensor | tuple[Tensor, ...]


class MicroBatchError(TypeError):
    """The batch handed to the pipeline is not a tensor or a tuple of tensors of one size."""


def as_tensors(batch: object, what: str = "pipeline input") -> tuple[tuple[Tensor, ...], bool]:
    """Normalise ``batch`` to a tuple of tensors.

    Args:
        batch: a tensor, or a tuple/list of tensors.
        what: how to name the value in an error message.

    Returns:
        ``(tensors, is_tuple)``: the tensors, and whether ``batch`` was a tuple.

    Raises:
        MicroBatchError: ``batch`` is neither a tensor nor a non-empty tuple of tensors.
    """
    if isinstance(batch, Tensor):
        return (batch,), False
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, Tensor) for t in batch):
        return tuple(batch), True
    if isinstance(batch, (tuple, list)):
        kinds = ", ".join(type(t).__name__ for t in batch) or "empty"
        raise MicroBatchError(
            f"{what} must be a tensor or a tuple of tensors, got a {type(batch).__name__} of ({kinds}); "
            "return plain tensors from each layer of the pipelined nn.Sequential"
        )
    raise MicroBatchError(
        f"{what} must be a tensor or a tuple of tensors, got {type(batch).__name__}; "
        "pass tensors to the pipelined nn.Sequential"
    )


def from_tensors(tensors: Sequence[Tensor], is_tuple: bool) -> Batch:
    """Inverse of :func:`as_tensors`."""
    return tuple(tensors) if is_tuple else tensors[0]


def batch_size(tensors: Sequence[Tensor], what: str = "pipeline input") -> int:
    """The common dim-0 size ``N`` of ``tensors``.

    Raises:
        MicroBatchError: a tensor is 0-dimensional, the sizes differ, or ``N`` is 0.
    """
    sizes = []
    for k, t in enumerate(tensors):
        if t.dim() == 0:
            raise MicroBatchError(f"{what}: tensor {k} is 0-dimensional; micro-batching needs a batch dim 0")
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise MicroBatchError(f"{what}: tensors disagree on the batch size (dim 0 sizes: {sizes})")
    if sizes[0] < 1:
        raise MicroBatchError(f"{what}: batch size is 0; the pipeline needs at least one sample")
    return sizes[0]


def check_chunks(chunks: Any) -> int:
    """Return ``chunks`` if it is an integer ≥ 1 (the number of micro-batches M).

    Raises:
        ValueError: anything else (a ``bool``, a float, a count below 1).
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(
            f"chunks must be an integer >= 1 (chunks: {chunks!r}); it is the number of micro-batches"
        )
    return chunks


def sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of the micro-batches of a mini-batch of ``batch_size`` samples: the one split rule.

    Near-equal, larger first (as ``torch.tensor_split``, which :func:`split` uses), and only
    ``batch_size`` micro-batches when ``batch_size < chunks``: ``sizes(10, 4) == [3, 3, 2, 2]``,
    ``sizes(2, 4) == [1, 1]``.

    Raises:
        TypeError: a count is not an ``int``.
        ValueError: a count below 1.
    """
    for name, value in (("batch_size", batch_size), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (got {type(value).__name__}: {value!r})")
        if value < 1:
            raise ValueError(f"{name} must be at least 1 (got {value})")
    m = min(batch_size, chunks)
    base, extra = divmod(batch_size, m)
    return [base + 1 if i < extra else base for i in range(m)]


def split(tensors: Sequence[Tensor], chunks: int) -> list[tuple[Tensor, ...]]:
    """Split tensors of batch size ``N`` into ``min(chunks, N)`` micro-batches.

    Shapes: each ``(N, *)`` → ``min(chunks, N) × (≈N/chunks, *)``; sizes differ by at most one,
    larger micro-batches first (``torch.tensor_split``).

    Raises:
        ValueError: ``chunks < 1``.
        MicroBatchError: see :func:`batch_size`.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    n = batch_size(tensors)
    m = min(chunks, n)
    parts = [torch.tensor_split(t, m, dim=0) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(m)]


def join(micro_batches: Sequence[Sequence[Tensor]]) -> tuple[Tensor, ...]:
    """Concatenate micro-batches back along dim 0: ``M × (n_i, *)`` → ``(Σ n_i, *)``."""
    return tuple(torch.cat(ts, dim=0) for ts in zip(*micro_batches))
