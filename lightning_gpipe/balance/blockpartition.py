"""Exact min-max partition of a sequence of layer costs into contiguous stages.

The problem: cut ``costs`` (one non-negative number per layer, in model order) into
``stages`` contiguous, non-empty blocks so that the largest block sum (the slowest or
largest pipeline stage) is as small as possible. torchgpipe solves it with the
block-partition algorithm of Bárány & Grinberg; here it is solved by dynamic programming
over suffixes, which is exact, short, and fast enough for the layer counts of real
pipelines (hundreds of layers).

Ties are broken deterministically. Among all partitionings, ``solve`` returns the one with the
smallest key

1. the stage costs sorted in descending order, compared lexicographically — so the largest
   stage is minimal first, then the second largest, and so on;
2. then the stage sizes (layer counts) sorted in descending order — the most even layer
   counts among equally costly partitionings (this matters for zero-cost layers such as
   activations);
3. then the balance list itself, the lexicographically largest — larger stages first, so
   that equal costs give the same balance as ``uniform_balance``.

Stage costs are the float sums ``sum(costs[a:b])`` (added left to right) and are compared
exactly, so the result is the same on every run and matches a brute-force search that
computes stage costs the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_gpipe.errors import check_count

__all__ = ["solve", "stage_costs", "validate_costs"]

# key of a (partial) partition, smaller is better:
# (costs sorted descending, sizes sorted descending, balance with every entry negated)
_Key = tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]


def validate_costs(costs: Sequence[float], stages: int) -> list[float]:
    """Checks ``costs`` and ``stages`` and returns the costs as a list of floats.

    Args:
        costs (Sequence[float]): cost of each layer, in model order.
        stages (int): number of stages.

    Returns:
        list[float]: the costs, converted to ``float``.

    Raises:
        TypeError: ``stages`` is not an ``int``.
        ValueError: ``stages < 1``, more stages than layers, or a cost that is
            negative, NaN or infinite.
    """
    check_count("stages", stages)
    values = [float(c) for c in costs]
    if stages > len(values):
        raise ValueError(
            f"more stages than layers (stages: {stages}, layers: {len(values)}); "
            f"every stage needs at least one layer: use at most {len(values)} stages "
            f"or split the model into more layers"
        )
    for index, value in enumerate(values):
        if math.isnan(value) or math.isinf(value) or value < 0:
            raise ValueError(f"layer costs must be finite and non-negative (layer {index}: {value})")
    return values


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Sums ``costs`` per stage of ``balance``: ``[sum(costs[0:n0]), sum(costs[n0:n0+n1]), ...]``."""
    result = []
    start = 0
    for size in balance:
        result.append(sum(float(c) for c in costs[start : start + size]))
        start += size
    return result


def _insert_descending(values: tuple, value: float | int) -> tuple:
    """Inserts ``value`` into the descending tuple ``values``, keeping it descending."""
    index = 0
    while index < len(values) and values[index] >= value:
        index += 1
    return values[:index] + (value,) + values[index:]


def solve(costs: Sequence[float], stages: int) -> list[int]:
    """Splits ``costs`` into ``stages`` contiguous blocks minimising the largest block sum.

    Exact dynamic programming over suffixes: ``best[j][a]`` is the best key (see the module
    docstring) for cutting layers ``a..L-1`` into ``j`` stages. Time ``O(K·L²)`` in the worst
    case for ``L`` layers and ``K`` stages; a candidate first stage stops growing as soon
    as its cost exceeds the best largest stage found so far, so typical inputs run much
    faster.

    Args:
        costs (Sequence[float]): cost of each layer (seconds, bytes, parameter counts: any
            additive, non-negative unit), in model order. Shape: ``(L,)``.
        stages (int): number of stages ``K``, ``1 <= K <= L``.

    Returns:
        list[int]: the balance, layers per stage: ``K`` integers, each ``>= 1``, summing to
        ``L``.

    Raises:
        TypeError: ``stages`` is not an ``int``.
        ValueError: ``stages < 1``, ``stages > len(costs)``, or a negative, NaN or
            infinite cost.

    Example:
        >>> solve([1, 1, 10, 1, 1], 3)
        [2, 1, 2]
    """
    values = validate_costs(costs, stages)
    n = len(values)

    # best[a]: best key for layers a..n-1 split into the current number of stages j.
    # j = 1: one stage holding the whole suffix.
    best: list[_Key | None] = [None] * (n + 1)
    for a in range(n):
        total = sum(values[a:])
        best[a] = ((total,), (n - a,), (a - n,))

    for j in range(2, stages + 1):
        new: list[_Key | None] = [None] * (n + 1)
        # a suffix starting at a needs at least j layers
        for a in range(n - j + 1):
            chosen: _Key | None = None
            cost = 0.0
            # first stage is layers a..a+size-1; the rest (j-1 stages) needs >= j-1 layers
            for size in range(1, n - a - (j - 1) + 1):
                cost += values[a + size - 1]
                if chosen is not None and cost > chosen[0][0]:
                    break  # costs are non-negative: a longer first stage only gets worse
                rest = best[a + size]
                assert rest is not None
                key: _Key = (
                    _insert_descending(rest[0], cost),
                    _insert_descending(rest[1], size),
                    (-size,) + rest[2],
                )
                if chosen is None or key < chosen:
                    chosen = key
            new[a] = chosen
        best = new

    result = best[0]
    assert result is not None
    return [-size for size in result[2]]
