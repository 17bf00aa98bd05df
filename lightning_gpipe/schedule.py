"""The GPipe fill-drain schedule, as data.

An :class:`Action` is ``(kind, micro_batch)`` printed like ``F2`` or ``B0``. A schedule is, for
every stage ``j``, the list of its actions at clock steps ``0 .. 2(M+K-1)-1``, with ``None``
where the stage idles (a bubble). For K=3 stages and M=4 micro-batches (Huang et al. 2019,
figure 2c)::

    step  stage0  stage1  stage2
       0  F0      .       .
       1  F1      F0      .
       2  F2      F1      F0
       3  F3      F2      F1
       4  .       F3      F2
       5  .       .       F3
       6  .       .       B3
       7  .       B3      B2
       8  B3      B2      B1
       9  B2      B1      B0
      10  B1      B0      .
      11  B0      .       .

Forward ``i`` on stage ``j`` runs at step ``i + j``; backwards run in reverse micro-batch
order, ``B i`` on stage ``j`` at step ``(M + K - 1) + (M - 1 - i) + (K - 1 - j)``. The bubble
share is ``(K - 1) / (M + K - 1)``. Each stage's executor consumes its own column in order
(:func:`stage_actions`); the clock only matters for printing, validation and simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: forward (``F``) or backward (``B``) of micro-batch ``i``."""

    kind: Kind
    i: int

    def __str__(self) -> str:
        return f"{self.kind}{self.i}"


Grid = list[list[Action | None]]  # grid[step][stage]


def fill_drain(stages: int, chunks: int) -> Grid:
    """The GPipe schedule as a ``step × stage`` grid (``None`` is a bubble).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1.
    """
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be >= 1 (stages: {stages}, chunks: {chunks})")
    k, m = stages, chunks
    half = m + k - 1
    grid: Grid = [[None] * k for _ in range(2 * half)]
    for j in range(k):
        for i in range(m):
            grid[i + j][j] = Action("F", i)
            grid[half + (m - 1 - i) + (k - 1 - j)][j] = Action("B", i)
    return grid


def stage_actions(grid: Grid, stage: int) -> list[Action]:
    """Stage ``stage``'s actions in execution order, bubbles dropped."""
    return [row[stage] for row in grid if row[stage] is not None]  # type: ignore[misc]


def validate(grid: Grid) -> None:
    """Check that a grid is a runnable pipeline schedule.

    Every stage runs each forward and each backward exactly once; ``F i`` on stage ``j`` comes
    after ``F i`` on stage ``j-1``; ``B i`` on stage ``j`` comes after ``B i`` on stage ``j+1``
    and after ``F i`` on stage ``j``.

    Raises:
        ValueError: naming the first violated rule, with the grid printed.
    """
    k = len(grid[0]) if grid else 0
    when: dict[tuple[str, int, int], int] = {}
    for step, row in enumerate(grid):
        for j, action in enumerate(row):
            if action is None:
                continue
            key = (action.kind, action.i, j)
            if key in when:
                raise ValueError(f"{action} runs twice on stage {j}\n{format_grid(grid)}")
            when[key] = step
    chunks = 1 + max((i for (_, i, _) in when), default=-1)
    for j in range(k):
        for i in range(chunks):
            for kind in ("F", "B"):
                if (kind, i, j) not in when:
                    raise ValueError(f"stage {j} never runs {kind}{i}\n{format_grid(grid)}")
    for j in range(k):
        for i in range(chunks):
            if j > 0 and when[("F", i, j)] <= when[("F", i, j - 1)]:
                raise ValueError(
                    f"F{i} on stage {j} runs before its input from stage {j - 1}\n{format_grid(grid)}"
                )
            if j < k - 1 and when[("B", i, j)] <= when[("B", i, j + 1)]:
                raise ValueError(
                    f"B{i} on stage {j} runs before its gradient from stage {j + 1}\n{format_grid(grid)}"
                )
            if when[("B", i, j)] <= when[("F", i, j)]:
                raise ValueError(f"B{i} on stage {j} runs before F{i}\n{format_grid(grid)}")


def bubble_share(grid: Grid) -> float:
    """Idle share of stage-steps: ``(K-1)/(M+K-1)`` for :func:`fill_drain`."""
    cells = [a for row in grid for a in row]
    return sum(a is None for a in cells) / len(cells) if cells else 0.0


def format_grid(grid: Grid) -> str:
    """Render the grid as the table in this module's docstring."""
    k = len(grid[0]) if grid else 0
    lines = ["step  " + "  ".join(f"stage{j}" for j in range(k))]
    for step, row in enumerate(grid):
        cells = [f"{str(a) if a is not None else '.':<6}" for a in row]
        lines.append(f"{step:>4}  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
