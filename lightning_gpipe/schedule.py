"""Pipeline schedules as data: what each stage runs, in order, and the messages each action implies.

An :class:`Action` is ``(kind, micro_batch)`` printed like ``F2`` or ``B0``. A schedule is a
*grid*: for every clock step, one cell per stage ``j`` holding that stage's action or ``None``
where it idles (a bubble). GPipe's fill-drain for K=3 stages and M=4 micro-batches (Huang et
al. 2019, figure 2c)::

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
share is ``(K - 1) / (M + K - 1)``.

Everything that runs a schedule reads it from here: each stage's executor
(:class:`lightning_gpipe.stage.PipelineStage`) consumes its own column in order
(:func:`stage_actions`), receiving and sending exactly the messages :func:`receives` and
:func:`sends` name and announcing their count (:func:`messages`) to its transport; the cost
model (:mod:`lightning_gpipe.simulate`) plays the same columns; :func:`format_grid` prints them.
A schedule is one function ``(stages, chunks) -> Grid`` (see :data:`SCHEDULES`); the clock only
matters for printing, validation and simulation.

1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's non-interleaved schedule, Narayanan
et al. SC 2021, figure 4 top) for K=3, M=4, each action one clock step (:func:`one_f_one_b`)::

    step  stage0  stage1  stage2
       0  F0      .       .
       1  F1      F0      .
       2  F2      F1      F0
       3  .       .       B0
       4  .       B0      F1
       5  B0      F2      B1
       6  F3      B1      F2
       7  B1      F3      B2
       8  .       B2      F3
       9  B2      .       B3
      10  .       B3      .
      11  B3      .       .

Same length and bubble as fill-drain, but stage ``j`` holds at most ``min(K - j, M)`` micro-batches'
activations at once (fill-drain: ``M``).

Where a column waits for the user's code: a forward on the first stage needs its micro-batch's
input, and a backward on the last stage needs its micro-batch's loss (:func:`needs_loss`). Under
``schedule="gpipe"`` the user's ``training_step`` runs once on the whole mini-batch, so every loss
exists only once it has returned and a stage's column runs in two phases, cut before its first
backward (:func:`split_phases`); under the other schedules it runs once per micro-batch
(:mod:`lightning_gpipe.microstep`) and the executor runs each column as far as it can between the
calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = [
    "SCHEDULES",
    "Action",
    "Grid",
    "Transfer",
    "bubble_share",
    "check_schedule",
    "fill_drain",
    "format_grid",
    "ideal_bubble",
    "messages",
    "needs_loss",
    "one_f_one_b",
    "place",
    "receives",
    "sends",
    "split_phases",
    "stage_actions",
    "validate",
]

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: forward (``F``) or backward (``B``) of micro-batch ``i``."""

    kind: Kind
    i: int

    def __str__(self) -> str:
        return f"{self.kind}{self.i}"


Grid = list[list[Action | None]]  # grid[step][stage]


class SkipRoute(Protocol):
    """A skip connection (:class:`lightning_gpipe.skip.Route`): stashed on ``source``, popped on ``target``."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> int: ...

    @property
    def target(self) -> int: ...


@dataclass(frozen=True)
class Transfer:
    """One message an action receives or sends.

    Attributes:
        peer: the other stage's index.
        skip: ``None`` for the stage boundary's tensors (activations in a forward, their
            gradients in a backward); else the name of a skip connection (its tensor in a
            forward, its gradient in a backward).
    """

    peer: int
    skip: str | None = None


def fill_drain(stages: int, chunks: int) -> Grid:
    """The GPipe schedule as a ``step × stage`` grid (``None`` is a bubble).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1.
    """
    _check_counts(stages, chunks)
    k, m = stages, chunks
    half = m + k - 1
    grid: Grid = [[None] * k for _ in range(2 * half)]
    for j in range(k):
        for i in range(m):
            grid[i + j][j] = Action("F", i)
            grid[half + (m - 1 - i) + (k - 1 - j)][j] = Action("B", i)
    return grid


def _check_counts(stages: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be >= 1 (stages: {stages}, chunks: {chunks})")


def one_f_one_b(stages: int, chunks: int) -> Grid:
    """1F1B (PipeDream-Flush) as a ``step × stage`` grid, each action one clock step.

    Stage ``j`` of K runs ``w = min(K - 1 - j, M)`` warm-up forwards ``F0 … F(w-1)``, then
    alternates one forward and one backward (``F(w) B0 F(w+1) B1 …``) and ends with the remaining
    backwards, in micro-batch order: Megatron-LM's non-interleaved schedule (Narayanan et al.,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
    figure 4 top; PipeDream-Flush in Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
    Training", ICML 2021). Stage ``j`` has at most ``min(K - j, M)`` micro-batches forwarded and not
    yet backwarded; the grid has fill-drain's length ``2·(M + K - 1)`` and bubble.

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1.
    """
    _check_counts(stages, chunks)
    columns = []
    for j in range(stages):
        warmup = min(stages - 1 - j, chunks)
        column = [Action("F", i) for i in range(warmup)]
        for i in range(chunks - warmup):
            column += [Action("F", warmup + i), Action("B", i)]
        column += [Action("B", i) for i in range(chunks - warmup, chunks)]
        columns.append(column)
    return place(columns)


def place(columns: Sequence[Sequence[Action]]) -> Grid:
    """The grid that runs each stage's column in order, every action one clock step, as early as possible.

    ``F i`` on stage ``j`` starts once stage ``j-1`` has finished ``F i``; ``B i`` once stage ``j+1``
    has finished ``B i`` (dependencies as :func:`validate` checks them).

    Args:
        columns: per stage, its actions in execution order.

    Raises:
        ValueError: the columns wait on each other forever (a dependency never runs first).
    """
    k = len(columns)
    done: dict[tuple[str, int, int], int] = {}  # (kind, i, stage) -> step it ran in
    cursor, free = [0] * k, [0] * k  # next action, first free step, per stage
    cells: dict[tuple[int, int], Action] = {}
    while any(cursor[j] < len(columns[j]) for j in range(k)):
        progressed = False
        for j in range(k):
            if cursor[j] == len(columns[j]):
                continue
            a = columns[j][cursor[j]]
            dep = (a.kind, a.i, j - 1 if a.kind == "F" else j + 1)
            if 0 <= dep[2] < k and dep not in done:
                continue
            step = max(free[j], done[dep] + 1 if 0 <= dep[2] < k else 0)
            cells[(step, j)] = a
            done[(a.kind, a.i, j)] = step
            cursor[j], free[j], progressed = cursor[j] + 1, step + 1, True
        if not progressed:
            stuck = ", ".join(
                f"stage {j}: {columns[j][cursor[j]]}" for j in range(k) if cursor[j] < len(columns[j])
            )
            raise ValueError(f"the columns wait on each other forever ({stuck})")
    steps = 1 + max((s for s, _ in cells), default=-1)
    return [[cells.get((s, j)) for j in range(k)] for s in range(steps)]


SCHEDULES: dict[str, Callable[[int, int], Grid]] = {"gpipe": fill_drain, "1f1b": one_f_one_b}
"""Every schedule by the name ``GPipeStrategy(schedule=...)`` takes: a function ``(stages, chunks) -> Grid``.

``"gpipe"`` (:func:`fill_drain`, the default) runs the user's ``training_step`` once per mini-batch;
every other schedule runs it once per micro-batch (:mod:`lightning_gpipe.microstep`)."""


def check_schedule(name: Any) -> str:
    """Return ``name`` if it names a schedule of :data:`SCHEDULES`.

    Raises:
        ValueError: any other value (the message lists the choices).
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        choices = ", ".join(repr(n) for n in SCHEDULES)
        raise ValueError(f"schedule must be one of {choices} (schedule: {name!r})")
    return name


def stage_actions(grid: Grid, stage: int) -> list[Action]:
    """Stage ``stage``'s actions in execution order, bubbles dropped."""
    return [row[stage] for row in grid if row[stage] is not None]  # type: ignore[misc]


def needs_loss(action: Action, stage: int, stages: int) -> bool:
    """Whether ``action`` needs the user's loss: a backward on the last stage."""
    return action.kind == "B" and stage == stages - 1


def split_phases(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """``(forward phase, backward phase)`` of a stage's column: cut before its first backward.

    Every backward's gradient starts at the user's loss, which under Lightning's automatic
    optimization exists only once the user's ``training_step`` has returned: the forward phase
    runs inside that step, the backward phase inside Lightning's ``backward``.
    """
    cut = next((k for k, a in enumerate(actions) if a.kind == "B"), len(actions))
    return list(actions[:cut]), list(actions[cut:])


def receives(action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = ()) -> list[Transfer]:
    """The messages ``action`` on ``stage`` receives, in the order it takes them.

    Forward: the stage input from the previous stage, then each skip popped here from its
    stashing stage. Backward: the output's gradient from the next stage, then the gradient of
    each skip stashed here from its popping stage. (On the last stage the output's gradient
    comes from the user's loss, not a message.) At run time a gradient message flows only for
    tensors that require a gradient.
    """
    skips = list(skips)
    if action.kind == "F":
        first = [Transfer(stage - 1)] if stage > 0 else []
        return first + [Transfer(r.source, r.name) for r in skips if r.target == stage and r.source != stage]
    first = [Transfer(stage + 1)] if stage < stages - 1 else []
    return first + [Transfer(r.target, r.name) for r in skips if r.source == stage and r.target != stage]


def sends(action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = ()) -> list[Transfer]:
    """The messages ``action`` on ``stage`` sends, in order: the mirror of :func:`receives`.

    Forward: the output to the next stage, then each skip stashed here to its popping stage.
    Backward: the input's gradient to the previous stage, then the gradient of each skip popped
    here to its stashing stage.
    """
    skips = list(skips)
    if action.kind == "F":
        first = [Transfer(stage + 1)] if stage < stages - 1 else []
        return first + [Transfer(r.target, r.name) for r in skips if r.source == stage and r.target != stage]
    first = [Transfer(stage - 1)] if stage > 0 else []
    return first + [Transfer(r.source, r.name) for r in skips if r.target == stage and r.source != stage]


def messages(
    actions: Iterable[Action],
    stage: int,
    stages: int,
    skips: Iterable[SkipRoute] = (),
    flows: Callable[[Action, Transfer], bool] = lambda action, transfer: True,
) -> Counter[int]:
    """How many messages ``actions`` receive from each peer stage (for the transport's announcements).

    Args:
        flows: whether a transfer really carries a message at run time (a gradient flows only
            for tensors that require one); default: all do.
    """
    skips = list(skips)
    return Counter(t.peer for a in actions for t in receives(a, stage, stages, skips) if flows(a, t))


def ideal_bubble(stages: int, chunks: int) -> float:
    """Bubble share of fill-drain with equal stages and free communication: ``(K-1)/(M+K-1)``.

    It equals :func:`bubble_share` of :func:`fill_drain` ``(K, M)``.

    Args:
        stages: number of stages ``K >= 1``.
        chunks: number of micro-batches ``M >= 1``.

    Returns:
        The idle fraction of stage time, in ``[0, 1)``.

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1.
    """
    _check_counts(stages, chunks)
    return (stages - 1) / (chunks + stages - 1)


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
