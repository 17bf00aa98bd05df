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
A schedule is one function ``(stages, chunks, virtual_stages=1) -> Grid`` (:class:`Schedule`,
by name in :data:`SCHEDULES`); the clock only matters for printing, validation and simulation.

Virtual stages (interleaved 1F1B, :func:`interleaved_1f1b`): the model is cut into ``K·v``
consecutive *parts* and stage ``j`` holds parts ``j, j+K, …, j+(v-1)K`` as its virtual stages
``0 … v-1`` (:func:`part`, :func:`holder`). An action names the virtual stage that runs it
(:attr:`Action.virtual_stage`, printed ``F2v1``); part ``c`` sends its output to part ``c+1`` on
stage ``(c+1) mod K`` (the last stage's virtual stage ``u`` to stage 0's virtual stage ``u+1``),
and each :class:`Transfer` names the peer's virtual stage. Without virtual stages (``v = 1``)
part = stage and every action's virtual stage is 0: grids, transfers and printing are as above.
Interleaved 1F1B for K=2, v=2, M=4 (stage 0 holds parts 0 and 2, stage 1 parts 1 and 3)::

    step  stage0  stage1
       0  F0v0    .
       1  F1v0    F0v0
       2  F0v1    F1v0
       3  F1v1    F0v1
       4  F2v0    B0v1
       5  B0v1    F1v1
       6  F3v0    B1v1
       7  B1v1    F2v0
       8  F2v1    B0v0
       9  B0v0    F3v0
      10  F3v1    B1v0
      11  B1v0    F2v1
      12  .       B2v1
      13  B2v1    F3v1
      14  .       B3v1
      15  B3v1    B2v0
      16  B2v0    B3v0
      17  B3v0    .

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

from lightning_gpipe.microbatch import sizes as microbatch_sizes

__all__ = [
    "SCHEDULES",
    "Action",
    "Grid",
    "Schedule",
    "Transfer",
    "bubble_share",
    "check_schedule",
    "check_virtual_stages",
    "fill_drain",
    "format_grid",
    "ideal_bubble",
    "in_send_order",
    "interleaved_1f1b",
    "messages",
    "needs_loss",
    "holder",
    "one_f_one_b",
    "part",
    "place",
    "receives",
    "send_order",
    "sends",
    "split_phases",
    "stage_actions",
    "validate",
    "virtual_stages_of",
]

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: forward (``F``) or backward (``B``) of micro-batch ``i``.

    Attributes:
        kind: ``"F"`` or ``"B"``.
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
        virtual_stage: the peer's virtual stage that sends or receives it (0 without virtual
            stages).
    """

    peer: int
    skip: str | None = None
    virtual_stage: int = 0


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


def interleaved_1f1b(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
    """Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2): each stage holds ``v`` virtual stages.

    The model is cut into ``K·v`` parts; stage ``j`` holds parts ``j, j+K, …, j+(v-1)K`` as its
    virtual stages ``0 … v-1`` (:func:`part`), so a micro-batch passes through every stage ``v``
    times and the bubble shrinks to about ``(K-1)/(v·M+K-1)`` (:func:`ideal_bubble`). Each
    stage's column is Megatron-LM's (``forward_backward_pipelining_with_interleaving``,
    ``get_schedule_table`` / ``get_model_chunk_id``):

    - the micro-batches form groups (Megatron-LM's "microbatch group per virtual stage"), ``K``
      each when ``K`` divides ``M``; otherwise ``max(1, M // K)`` groups of near-equal sizes,
      larger first (``M = 5, K = 2``: 3 and 2; ``M < K``: one group of ``M``), which keeps the
      pipeline fed where Megatron-LM requires ``M mod K = 0``. A stage's forwards run group by
      group, within a group virtual stage by virtual stage, within that micro-batch by
      micro-batch; its backwards run in the same order with the virtual stages reversed (the
      last part's backward first);
    - stage ``j`` first runs ``min(2(K-1-j) + (v-1)·g, v·M)`` forwards (the warm-up; ``g`` the
      first group's size), then alternates one forward and one backward, then runs the
      backwards left. With ``v = 1`` it is :func:`one_f_one_b` (warm-up ``min(K-1-j, M)``).

    The backward of micro-batch ``i`` on the last part starts from micro-batch ``i``'s own loss,
    so the loss must exist per micro-batch (a stage's column interleaves forwards and backwards).
    The grid places each column's actions in order, each as early as its inputs allow (one step
    per action).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1); any M, including ``M < K`` and ``M mod K ≠ 0``.
        virtual_stages: virtual stages per stage v (≥ 1; ≥ 2 needs ``K ≥ 2``).

    Raises:
        ValueError: a count below 1, or ``virtual_stages > 1`` with one stage.

    The grid for K=2, v=2, M=4 is in this module's docstring.
    """
    _check_counts(stages, chunks)
    _check_count("virtual_stages", virtual_stages)
    if virtual_stages > 1 and stages == 1:
        raise ValueError(
            f"virtual stages need two or more pipeline stages (stages: {stages}, virtual_stages: {virtual_stages}); "
            "use virtual_stages=1 or more stages"
        )
    if virtual_stages == 1:
        return one_f_one_b(stages, chunks)
    k, m, v = stages, chunks, virtual_stages
    groups = microbatch_sizes(m, max(1, m // k))
    starts = [sum(groups[:n]) for n in range(len(groups))]
    table = [  # Megatron-LM's schedule table: (micro-batch, virtual stage) in forward order
        (start + n, u) for start, size in zip(starts, groups) for u in range(v) for n in range(size)
    ]
    columns = []
    for j in range(k):
        warmup = min(2 * (k - 1 - j) + (v - 1) * groups[0], v * m)
        forwards = [Action("F", i, u) for i, u in table]
        backwards = [Action("B", i, v - 1 - u) for i, u in table]
        column = forwards[:warmup]
        for n in range(len(table) - warmup):
            column += [forwards[warmup + n], backwards[n]]
        columns.append(column + backwards[len(table) - warmup :])
    return place(columns)


def _check_counts(stages: int, chunks: int) -> None:
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages and chunks must be >= 1 (stages: {stages}, chunks: {chunks})")


def one_f_one_b(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
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
        virtual_stages: must be 1 (:func:`interleaved_1f1b` holds several per stage).

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1, or ``virtual_stages`` other than 1.
    """
    _check_counts(stages, chunks)
    _check_one_virtual_stage("1f1b", virtual_stages)
    return place(_one_f_one_b_columns(stages, chunks))


def _one_f_one_b_columns(stages: int, chunks: int) -> list[list[Action]]:
    """1F1B's columns: warm-up forwards, one forward one backward, the remaining backwards."""
    columns = []
    for j in range(stages):
        warmup = min(stages - 1 - j, chunks)
        column = [Action("F", i) for i in range(warmup)]
        for i in range(chunks - warmup):
            column += [Action("F", warmup + i), Action("B", i)]
        column += [Action("B", i) for i in range(chunks - warmup, chunks)]
        columns.append(column)
    return columns


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({name}: {value!r})")


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
    """The model part that stage ``stage``'s virtual stage ``virtual_stage`` holds: ``stage + virtual_stage·stages``.

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
    ``i``'s loss); dependencies as :func:`validate` checks them. Without virtual stages, part =
    stage.

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


SCHEDULES: dict[str, Schedule] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
}
"""Every schedule by the name ``GPipeStrategy(schedule=...)`` takes: a function
``(stages, chunks, virtual_stages=1) -> Grid`` (:class:`Schedule`); only ``"interleaved_1f1b"``
runs more than one virtual stage per stage.

``"gpipe"`` (:func:`fill_drain`, the default) runs the user's ``training_step`` once per mini-batch;
every other schedule runs it once per micro-batch (:mod:`lightning_gpipe.microstep`)."""


def check_virtual_stages(name: str, virtual_stages: Any, stages: int = 2) -> int:
    """Return ``virtual_stages`` if schedule ``name`` runs that many virtual stages per stage on ``stages`` stages.

    ``None`` picks the schedule's default: 2 for ``"interleaved_1f1b"`` (interleaving with one
    virtual stage would be plain 1F1B), 1 for the others.

    Raises:
        ValueError: not ``None`` or an integer >= 1, or the schedule cannot run it (only
            ``"interleaved_1f1b"`` runs more than one; it needs two or more stages).
    """
    if virtual_stages is None:
        virtual_stages = 2 if name == "interleaved_1f1b" else 1
    _check_count("virtual_stages", virtual_stages)
    SCHEDULES[name](stages, 1, virtual_stages)  # each schedule refuses what it cannot run
    return int(virtual_stages)


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


def needs_loss(action: Action, stage: int, stages: int, virtual_stages: int = 1) -> bool:
    """Whether ``action`` needs the user's loss: a backward on the last part (the last stage's last virtual stage)."""
    return action.kind == "B" and part(stage, action.virtual_stage, stages) == stages * virtual_stages - 1


def split_phases(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """``(forward phase, backward phase)`` of a stage's column: cut before its first backward.

    Every backward's gradient starts at the user's loss, which under Lightning's automatic
    optimization exists only once the user's ``training_step`` has returned: the forward phase
    runs inside that step, the backward phase inside Lightning's ``backward``.
    """
    cut = next((k for k, a in enumerate(actions) if a.kind == "B"), len(actions))
    return list(actions[:cut]), list(actions[cut:])


def _transfer(other: int, stages: int, skip: str | None = None) -> Transfer:
    """The transfer to or from model part ``other``: its stage and virtual stage."""
    stage, virtual_stage = holder(other, stages)
    return Transfer(stage, skip, virtual_stage)


def receives(
    action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = (), virtual_stages: int = 1
) -> list[Transfer]:
    """The messages ``action`` on ``stage`` receives, in the order it takes them.

    Forward: the part's input from the previous part, then each skip popped here from its
    stashing part. Backward: the output's gradient from the next part, then the gradient of
    each skip stashed here from its popping part. (On the last part the output's gradient
    comes from the user's loss, not a message.) At run time a gradient message flows only for
    tensors that require a gradient. With virtual stages, skip routes name parts
    (:func:`part`); part ``c``'s next part ``c+1`` lives on stage ``(c+1) mod K``, so the last
    stage's virtual stage ``u`` sends to stage 0's virtual stage ``u+1``.
    """
    skips = list(skips)
    c, last = part(stage, action.virtual_stage, stages), stages * virtual_stages - 1
    if action.kind == "F":
        first = [_transfer(c - 1, stages)] if c > 0 else []
        return first + [_transfer(r.source, stages, r.name) for r in skips if r.target == c and r.source != c]
    first = [_transfer(c + 1, stages)] if c < last else []
    return first + [_transfer(r.target, stages, r.name) for r in skips if r.source == c and r.target != c]


def sends(
    action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = (), virtual_stages: int = 1
) -> list[Transfer]:
    """The messages ``action`` on ``stage`` sends, in order: the mirror of :func:`receives`.

    Forward: the output to the next part, then each skip stashed here to its popping part.
    Backward: the input's gradient to the previous part, then the gradient of each skip popped
    here to its stashing part.
    """
    skips = list(skips)
    c, last = part(stage, action.virtual_stage, stages), stages * virtual_stages - 1
    if action.kind == "F":
        first = [_transfer(c + 1, stages)] if c < last else []
        return first + [_transfer(r.target, stages, r.name) for r in skips if r.source == c and r.target != c]
    first = [_transfer(c - 1, stages)] if c > 0 else []
    return first + [_transfer(r.source, stages, r.name) for r in skips if r.target == c and r.source != c]


def messages(
    actions: Iterable[Action],
    stage: int,
    stages: int,
    skips: Iterable[SkipRoute] = (),
    flows: Callable[[Action, Transfer], bool] = lambda action, transfer: True,
    virtual_stages: int = 1,
) -> Counter[int]:
    """How many messages ``actions`` receive from each peer stage (for the transport's announcements).

    Args:
        flows: whether a transfer really carries a message at run time (a gradient flows only
            for tensors that require one); default: all do.
        virtual_stages: virtual stages per stage v (default 1).
    """
    skips = list(skips)
    return Counter(
        t.peer for a in actions for t in receives(a, stage, stages, skips, virtual_stages) if flows(a, t)
    )


def send_order(
    grid: Grid, stage: int, peer: int, skips: Iterable[SkipRoute] = ()
) -> list[tuple[Action, Transfer]]:
    """The messages ``peer`` sends ``stage`` in one step, in the order ``peer`` sends them.

    Each is named as ``stage`` takes it: ``(the action on stage that receives it, the transfer
    as that action's`` :func:`receives` ``names it)``. The transport delivers one peer's
    messages in the order sent; where a stage takes them in another order
    (:func:`in_send_order` is false: interleaved 1F1B with two stages and a micro-batch group of
    odd size, whose stages exchange activations and gradients in both directions), the stage
    receives them in this order and holds each until its action runs. ``grid`` gives the
    number of virtual stages (:func:`virtual_stages_of`).
    """
    k, v = len(grid[0]) if grid else 0, virtual_stages_of(grid)
    skips = list(skips)
    return [
        (Action(a.kind, a.i, t.virtual_stage), Transfer(peer, t.skip, a.virtual_stage))
        for a in stage_actions(grid, peer)
        for t in sends(a, peer, k, skips, v)
        if t.peer == stage
    ]


def in_send_order(grid: Grid, skips: Iterable[SkipRoute] = ()) -> bool:
    """Whether every stage's column takes each peer's messages in the order the peer sends them.

    True for :func:`fill_drain` and, with three or more stages, for :func:`interleaved_1f1b`
    (each ordered pair of stages then carries one kind of message); see :func:`send_order`.
    """
    k, v = len(grid[0]) if grid else 0, virtual_stages_of(grid)
    skips = list(skips)
    for stage in range(k):
        taken = [(a, t) for a in stage_actions(grid, stage) for t in receives(a, stage, k, skips, v)]
        for peer in range(k):
            if [x for x in taken if x[1].peer == peer] != send_order(grid, stage, peer, skips):
                return False
    return True


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
    _check_count("virtual_stages", virtual_stages)
    return (stages - 1) / (virtual_stages * chunks + stages - 1)


def validate(grid: Grid) -> None:
    """Check that a grid is a runnable pipeline schedule.

    Every part runs each forward and each backward exactly once; ``F i`` on part ``c`` comes
    after ``F i`` on part ``c-1``; ``B i`` on part ``c`` comes after ``B i`` on part ``c+1``
    and after ``F i`` on part ``c``. Without virtual stages, part = stage.

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
