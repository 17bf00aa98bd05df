"""GPipe's fill-drain schedule (Huang et al. 2019, figure 2c); its grid for K=3, M=4 is in
:mod:`lightning_gpipe.schedule`'s docstring."""

from __future__ import annotations

from lightning_gpipe.schedule.grid import Action, Grid, _check_counts, _check_one_virtual_stage

__all__ = ["fill_drain"]


def fill_drain(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
    """The GPipe schedule as a ``step × stage`` grid (``None`` is a bubble).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).
        virtual_stages: must be 1: fill-drain runs one part of the model per stage.

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1, or ``virtual_stages`` other than 1.
    """
    _check_counts(stages, chunks)
    _check_one_virtual_stage("gpipe", virtual_stages)
    k, m = stages, chunks
    half = m + k - 1
    grid: Grid = [[None] * k for _ in range(2 * half)]
    for j in range(k):
        for i in range(m):
            grid[i + j][j] = Action("F", i)
            grid[half + (m - 1 - i) + (k - 1 - j)][j] = Action("B", i)
    return grid
