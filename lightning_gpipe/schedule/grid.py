"""The grid: actions, model parts on stages, columns placed on the clock, validated, printed, the bubble.

Virtual stages (interleaved 1F1B, :func:`interleaved_1f1b`): the model is cut into ``K·v``
consecutive *parts* and stage ``j`` holds parts ``j, j+K, …, j+(v-1)K`` as its virtual stages
``0 … v-1`` (:func:`part`, :func:`holder`). An action names the virtual stage that runs it
(:attr:`Action.virtual_stage`, printed ``F2v1``); part ``c`` sends its output to part ``c+1`` on
stage ``(c+1) mod K`` (the last stage's virtual stage ``u`` to stage 0's virtual stage ``u+1``),
and each :class:`Transfer` names the peer's virtual stage. Without virtual stages (``v = 1``)
part = stage and every action's virtual stage is 0: grids, transfers and printing are as in
:mod:`lightning_gpipe.schedule`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from lightning_gpipe.errors import check_count

__all__ = [
    "Action",
    "Grid",
    "Schedule",
    "bubble_share",
    "format_grid",
    "holder",
    "ideal_bubble",
    "needs_loss",
    "part",
    "place",
    "split_phases",
    "stage_actions",
    "validate",
    "virtual_stages_of",
]

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: forward (``F``), backward (``B``) or weight gradients (``W``) of
    micro-batch ``i``.

    ``B i`` is the whole backward unless the stage's column also runs ``W i``: then ``B i``
    computes the gradient of the stage's inputs only (what the previous stage waits for) and
    ``W i`` the gradients of its weights (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
    section 2; :func:`~lightning_gpipe.schedule.zb_h1`, :mod:`lightning_gpipe.engine.backward_split`).

    Attributes:
        kind: ``"F"``, ``"B"`` or ``"W"``.
        i: the micro-batch, ``0 <= i < M``.
        virtual_stage: which of its stage's ``v`` virtual stages runs it, ``0 <= u < v``
            (default 0: the stage's only one). Stage ``j``'s virtual stage ``u`` holds the
            model's part ``j + u·K`` (:func:`part`).
    """

    kind: Kind
    i: int
    virtual_stage: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.i}" + (f"v{self.virtual_stage}" if self.virtual_stage else "")


Grid = list[list[Action | None]]  # grid[step][stage]


def _check_counts(stages: int, chunks: int) -> None:
    check_count("stages", stages)
    check_count("chunks", chunks)


def sizes(batch_size: int, chunks: int, min_size: int = 1) -> list[int]:
    """Sizes of the micro-batches of a mini-batch of ``batch_size`` samples: the one split rule.

    Near-equal, larger first (as ``torch.tensor_split``), and only
    ``batch_size`` micro-batches when ``batch_size < chunks``: ``sizes(10, 4) == [3, 3, 2, 2]``,
    ``sizes(2, 4) == [1, 1]``. With ``min_size``, at most ``batch_size // min_size`` micro-batches
    (at least one), so that each holds ``min_size`` samples or more where the batch has as many
    (a model with BatchNorm under ``batch_norm="micro_batch"``: 2; issue 40):
    ``sizes(12, 8, min_size=2) == [2] * 6``.

    Raises:
        TypeError: a count is not an ``int``.
        ValueError: a count below 1.
    """
    check_count("batch_size", batch_size)
    check_count("chunks", chunks)
    check_count("min_size", min_size)
    m = min(max(1, batch_size // min_size), chunks)
    base, extra = divmod(batch_size, m)
    return [base + 1 if i < extra else base for i in range(m)]


def _check_one_virtual_stage(name: str, virtual_stages: int) -> None:
    if virtual_stages != 1:
        raise ValueError(
            f"the {name} schedule runs one virtual stage per stage (virtual_stages: {virtual_stages!r}); "
            "use the interleaved_1f1b schedule for virtual stages"
        )


class Schedule(Protocol):
    """A schedule function: ``(stages K, chunks M, virtual_stages v) -> Grid``, K columns.

    Raises ``ValueError`` for counts below 1 and for a ``virtual_stages`` it cannot run.
    """

    def __call__(self, stages: int, chunks: int, virtual_stages: int = 1) -> Grid: ...


def part(stage: int, virtual_stage: int, stages: int) -> int:
    """The model part that stage ``stage``'s virtual stage ``virtual_stage`` holds:
    ``stage + virtual_stage·stages``.

    The model is cut into ``stages × v`` consecutive parts; part ``c`` lives on stage ``c mod K``
    as its virtual stage ``c // K`` (:func:`holder`). Without virtual stages, part = stage.
    """
    return stage + virtual_stage * stages


def holder(part: int, stages: int) -> tuple[int, int]:
    """``(stage, virtual_stage)`` holding model part ``part``: the inverse of :func:`part`."""
    virtual_stage, stage = divmod(part, stages)
    return stage, virtual_stage


def virtual_stages_of(grid: Grid) -> int:
    """``v``: the number of virtual stages a grid's stages hold (1 + the largest ``virtual_stage``)."""
    return 1 + max((a.virtual_stage for row in grid for a in row if a is not None), default=0)


def place(columns: Sequence[Sequence[Action]]) -> Grid:
    """The grid that runs each stage's column in order, every action one clock step, as early as possible.

    ``F i`` of part ``c`` starts once ``F i`` of part ``c-1`` has finished; ``B i`` of part ``c``
    once ``B i`` of part ``c+1`` and ``F i`` of part ``c`` have (on the last part: micro-batch
    ``i``'s loss); ``W i`` once ``B i`` of its part has; dependencies as :func:`validate` checks
    them. Without virtual stages, part = stage.

    Args:
        columns: per stage, its actions in execution order.

    Raises:
        ValueError: the columns wait on each other forever (a dependency never runs first),
            naming the action each stuck stage waits on.
    """
    k = len(columns)
    v = 1 + max((a.virtual_stage for column in columns for a in column), default=0)
    last = k * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, i, part) -> step it ran
    position = [0] * k
    grid: Grid = []
    while any(position[j] < len(columns[j]) for j in range(k)):
        row: list[Action | None] = [None] * k
        step = len(grid)
        for j in range(k):
            if position[j] == len(columns[j]):
                continue
            action = columns[j][position[j]]
            c = part(j, action.virtual_stage, k)
            if action.kind == "F":
                inputs = [("F", action.i, c - 1)] if c > 0 else []
            elif action.kind == "W":
                inputs = [("B", action.i, c)]
            else:
                inputs = [("F", action.i, c)] + ([("B", action.i, c + 1)] if c < last else [])
            if all(done.get(key, step) < step for key in inputs):
                row[j] = action
                position[j] += 1
        if all(a is None for a in row):
            stuck = ", ".join(
                f"stage {j}: {columns[j][position[j]]}" for j in range(k) if position[j] < len(columns[j])
            )
            raise ValueError(f"the columns wait on each other forever ({stuck})")
        for j, placed in enumerate(row):
            if placed is not None:
                done[(placed.kind, placed.i, part(j, placed.virtual_stage, k))] = step
        grid.append(row)
    return grid


def stage_actions(grid: Grid, stage: int) -> list[Action]:
    """Stage ``stage``'s actions in execution order, bubbles dropped."""
    return [row[stage] for row in grid if row[stage] is not None]  # type: ignore[misc]


def needs_loss(action: Action, stage: int, stages: int, virtual_stages: int = 1) -> bool:
    """Whether ``action`` needs the user's loss: a backward on the last part (the last stage's last
    virtual stage)."""
    return action.kind == "B" and part(stage, action.virtual_stage, stages) == stages * virtual_stages - 1


def split_phases(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """``(forward phase, backward phase)`` of a stage's column: cut before its first backward.

    Every backward's gradient starts at the user's loss, which under Lightning's automatic
    optimization exists only once the user's ``training_step`` has returned: the forward phase
    runs inside that step, the backward phase inside Lightning's ``backward``.
    """
    cut = next((k for k, a in enumerate(actions) if a.kind == "B"), len(actions))
    return list(actions[:cut]), list(actions[cut:])


def ideal_bubble(stages: int, chunks: int, virtual_stages: int = 1) -> float:
    """Bubble share with equal stages and free communication: ``(K-1)/(v·M+K-1)``.

    With ``v = 1`` it is fill-drain's ``(K-1)/(M+K-1)`` and equals :func:`bubble_share` of
    :func:`fill_drain` ``(K, M)``; 1F1B has the same bubble. With ``v`` virtual stages per
    stage each part takes ``1/v`` of a stage's time and the bubble shrinks to
    ``((K-1)/v)/(M+(K-1)/v)``: the pipeline's throughput is at most ``K·M/(M+(K-1)/v)`` times
    one stage's (Narayanan et al., SC 2021, section 2.2.1).

    Args:
        stages: number of stages ``K >= 1``.
        chunks: number of micro-batches ``M >= 1``.
        virtual_stages: virtual stages per stage ``v >= 1`` (default 1).

    Returns:
        The idle fraction of stage time, in ``[0, 1)``.

    Raises:
        ValueError: a count below 1.
    """
    _check_counts(stages, chunks)
    check_count("virtual_stages", virtual_stages)
    return (stages - 1) / (virtual_stages * chunks + stages - 1)


def validate(grid: Grid) -> None:
    """Check that a grid is a runnable pipeline schedule.

    Every part runs each forward and each backward exactly once; ``F i`` on part ``c`` comes
    after ``F i`` on part ``c-1``; ``B i`` on part ``c`` comes after ``B i`` on part ``c+1``
    and after ``F i`` on part ``c``; a ``W i`` (at most one per part) after ``B i`` on its part.
    Without virtual stages, part = stage.

    Raises:
        ValueError: naming the first violated rule, with the grid printed.
    """
    k = len(grid[0]) if grid else 0
    v = virtual_stages_of(grid)
    when: dict[tuple[str, int, int], int] = {}
    for step, row in enumerate(grid):
        for j, action in enumerate(row):
            if action is None:
                continue
            key = (action.kind, action.i, part(j, action.virtual_stage, k))
            if key in when:
                raise ValueError(f"{action} runs twice on stage {j}\n{format_grid(grid)}")
            when[key] = step
    chunks = 1 + max((i for (_, i, _) in when), default=-1)

    def where(c: int) -> str:
        stage, u = holder(c, k)
        return f"stage {stage}" if v == 1 else f"part {c} (stage {stage}, virtual stage {u})"

    parts = k * v
    for c in range(parts):
        for i in range(chunks):
            for kind in ("F", "B"):
                if (kind, i, c) not in when:
                    raise ValueError(f"{where(c)} never runs {kind}{i}\n{format_grid(grid)}")
    for c in range(parts):
        for i in range(chunks):
            if c > 0 and when[("F", i, c)] <= when[("F", i, c - 1)]:
                raise ValueError(
                    f"F{i} on {where(c)} runs before its input from {where(c - 1)}\n{format_grid(grid)}"
                )
            if c < parts - 1 and when[("B", i, c)] <= when[("B", i, c + 1)]:
                raise ValueError(
                    f"B{i} on {where(c)} runs before its gradient from {where(c + 1)}\n{format_grid(grid)}"
                )
            if when[("B", i, c)] <= when[("F", i, c)]:
                raise ValueError(f"B{i} on {where(c)} runs before F{i}\n{format_grid(grid)}")
            if when.get(("W", i, c), when[("B", i, c)] + 1) <= when[("B", i, c)]:
                raise ValueError(f"W{i} on {where(c)} runs before B{i}\n{format_grid(grid)}")


def bubble_share(grid: Grid) -> float:
    """Idle share of stage-steps: ``(K-1)/(M+K-1)`` for :func:`fill_drain`."""
    cells = [a for row in grid for a in row]
    return sum(a is None for a in cells) / len(cells) if cells else 0.0


def format_grid(grid: Grid) -> str:
    """Render the grid as the table in this module's docstring.

    With virtual stages every cell names its virtual stage: ``F2v1`` is the forward of
    micro-batch 2 on the stage's virtual stage 1 (stage ``j``'s part ``j + K``).
    """
    k = len(grid[0]) if grid else 0
    v = virtual_stages_of(grid)

    def cell(a: Action | None) -> str:
        if a is None:
            return "."
        return f"{a.kind}{a.i}v{a.virtual_stage}" if v > 1 else str(a)

    lines = ["step  " + "  ".join(f"stage{j}" for j in range(k))]
    for step, row in enumerate(grid):
        cells = [f"{cell(a):<6}" for a in row]
        lines.append(f"{step:>4}  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
