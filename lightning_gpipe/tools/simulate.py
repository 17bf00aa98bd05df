"""Cost model of a pipeline schedule: step time, bubble share, activation memory.

GPipe (Huang et al., 2019, arXiv 1811.06965) runs K stages on M micro-batches: stage j
runs forward on micro-batch i as soon as it is free and micro-batch i has arrived from
stage j-1; after all M forwards, backwards run in reverse micro-batch order, stage j
starting backward i once its gradient has arrived from stage j+1. With K = 3, M = 4 and
equal stages (``F``/``B`` with the micro-batch index, ``.`` idle; one column per forward
time, a backward as long as a forward here)::

    stage 0: F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1: .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

Each stage idles ``K-1`` of ``M+K-1`` slots in each direction: the bubble share
``(K-1)/(M+K-1)`` (:func:`lightning_gpipe.schedule.ideal_bubble`). ``simulate`` does not use
that formula: it plays each stage's column of any schedule of
:data:`lightning_gpipe.schedule.SCHEDULES` (fill-drain by default; 1F1B; interleaved 1F1B with
``v`` virtual stages per stage) action by action, with the transfers
:func:`lightning_gpipe.schedule.sends` names and the recompute rule of
:mod:`lightning_gpipe.engine.recompute` (the same data the stages execute), so unequal stages,
communication delays, re-materialization and each schedule's order come out right. The memory
estimate (:func:`peak_activation_memory`) plays the same columns: what a stage holds for
backward grows with every forward and shrinks with every backward, so fill-drain's peak grows
with M while 1F1B's is bounded by the micro-batches in flight (``K-j`` on stage ``j``).

Model, in seconds and bytes:

- compute: stage j's forward of one micro-batch takes ``forward[j]``, its backward
  ``backward[j]``; a re-materialized micro-batch first repeats the forward (``"R"``,
  ``forward[j]`` seconds) when its backward is due, after its gradient has arrived. With
  ``v`` virtual stages each of stage j's parts takes ``1/v`` of those times, unless ``K·v``
  values give each part's own (part ``c`` is stage ``c mod K``'s virtual stage ``c // K``:
  :func:`lightning_gpipe.schedule.part`). A schedule with ``W`` actions (``"zb_h1"``) splits a
  backward into its input gradient (``B``, ``backward[j] - weight_backward[j]``) and its weight
  gradients (``W``, ``weight_backward[j]``), and its graph is held until the ``W``;
- communication: a micro-batch's activation (forward) or gradient (backward) crossing
  boundary c (between parts c and c+1; without virtual stages, stages) is
  ``boundary_bytes[c]`` bytes. Sends are asynchronous (the sender does not wait). One
  transfer at a time per link (ordered pair of stages): it occupies the link for
  ``bytes / bandwidth`` and arrives ``latency`` later;
- the loss is part of the last part's forward time, and micro-batch i's backward on the last
  part may start once its forward is done (fill-drain's column runs every forward first);
  the optimizer step is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_gpipe import schedule as schedule_module
from lightning_gpipe.engine.recompute import recomputed
from lightning_gpipe.errors import check_count
from lightning_gpipe.schedule import SCHEDULES, Action, Grid, Schedule
from lightning_gpipe.schedule import sizes as microbatch_sizes

__all__ = ["Event", "Simulation", "peak_activation_memory", "simulate"]


class Event(NamedTuple):
    """One stretch of work on a stage: ``kind`` is ``"F"`` (forward), ``"R"`` (recompute:
    the forward repeated before a backward), ``"B"`` (backward; the input gradient only where
    the schedule splits it) or ``"W"`` (the weight gradients); times in seconds from the
    start of the step; ``virtual_stage``: which of the stage's virtual stages ran it (0 without)."""

    kind: str
    microbatch: int
    start: float
    end: float
    virtual_stage: int = 0


@dataclass(frozen=True)
class Simulation:
    """Prediction for one training step (one mini-batch).

    Attributes:
        step_time (float): seconds from the first forward to the last backward.
        bubble (float): idle share of stage time, ``1 - sum(busy) / (K × step_time)``; 0
            when the step takes no time.
        busy (list[float]): seconds each stage computes (forward, recompute and backward),
            shape ``(K,)``.
        peak_activation_bytes (list[float] | None): per stage, the largest bytes of
            activations held for backward (see ``peak_activation_memory``), shape ``(K,)``;
            None when no ``batch_size`` was given.
        timeline (list[list[Event]] | None): per stage, its events in order; None unless
            requested.
    """

    step_time: float
    bubble: float
    busy: list[float]
    peak_activation_bytes: list[float] | None = None
    timeline: list[list[Event]] | None = None


def peak_activation_memory(
    stages: int,
    chunks: int,
    batch_size: int,
    activation_bytes: float | Sequence[float],
    input_bytes: float | Sequence[float] = 0.0,
    checkpoint: str = "except_last",
    *,
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    workspace_bytes: float | Sequence[float] = 0.0,
    output_bytes: float = 0.0,
) -> list[float]:
    """Peak bytes of activations each stage holds for backward during one step.

    A part holds, per sample, ``activation_bytes`` (``a``) for a micro-batch whose activations
    are kept, or only its boundary input ``input_bytes`` (``b``) for a re-materialized one, which
    then needs its ``a`` again while its backward runs. The holdings are played through the
    schedule's column of each stage (every forward adds, every backward frees its micro-batch
    on its part) and each stage's maximum over all its parts together is returned. Under
    fill-drain, with ``M`` equal micro-batches of ``N/M`` on stage ``k``:

    - ``"never"``: ``N·a_k`` — all activations of the mini-batch;
    - ``"always"``: ``N·b_k + (N/M)·a_k`` — the boundary inputs of all micro-batches plus
      one micro-batch's activations, GPipe's ``O(N + (L/K)·(N/M))``;
    - ``"except_last"``: ``(N - N/M)·b_k + (N/M)·a_k``.

    Under 1F1B stage ``k`` holds at most ``K-k`` micro-batches, whatever M: ``"never"`` gives
    ``min(K-k, M)·(N/M)·a_k``.

    ``a`` is treated as the part's inner activations; if it also counts the boundary input
    (and output), as the benchmark's profile does, the estimate with re-materialization is high
    by one micro-batch's ``b`` while the recompute's backward runs.

    Two terms count what a backward needs beyond what was kept, so that the estimate is the peak
    a memory meter sees during the step (both 0 by default: the kept bytes alone):

    - ``workspace_bytes`` (``w``, bytes): one micro-batch's backward peak on a part above what
      its forward kept, added while each backward runs: the gradient arriving from the next
      part, the activation gradients passed between layers, and each weight's gradient before
      it is added into ``.grad`` (a Linear(1024, 1024)'s is 4 MiB, whatever the micro-batch).
      Measured on a micro-batch of the run's size (it depends on it);
    - ``output_bytes`` (``o``, bytes per sample): the last part's output, which the loss
      receives; while the last part's backwards run, the loss's side is alive, ``2·o`` per
      sample (the output's gradient and a loss buffer as large as the output, e.g.
      ``F.mse_loss``'s element-wise one; the output itself is the part's, in ``a``): one micro-batch's (``2·o·N/M``) under schedules that run the loss
      per micro-batch, the whole mini-batch's (``2·o·N``) under ``"gpipe"``, whose
      ``training_step`` sees the joined output of all micro-batches.

    So 1F1B's ``"never"`` peak on the last stage is ``(N/M)·a + w + 2·o·N/M``, and GPipe's
    ``N·a + w + 2·o·N``. Under the schedules that run the loss per micro-batch, the last call's
    loss side stays alive (Lightning holds the loss, whose graph holds the output's gradient)
    until the next call: a backward of another part of the last stage (interleaved) counts it.

    Args:
        stages (int): number of stages ``K``.
        chunks (int): number of micro-batches ``M`` (fewer if ``N < M``).
        batch_size (int): mini-batch size ``N``.
        activation_bytes: ``a``, bytes per sample that a stage keeps for backward without
            re-materialization; a scalar or ``K`` values (each of a stage's ``v`` parts keeps
            ``1/v`` of it), or ``K·v`` values, one per part.
        input_bytes: ``b``, bytes per sample of a part's input; a scalar, ``K`` values (every
            part of a stage) or ``K·v`` values (default: 0).
        checkpoint (str): ``"always"``, ``"except_last"`` or ``"never"`` (default:
            ``"except_last"``).
        schedule: a name in :data:`~lightning_gpipe.schedule.SCHEDULES` or a schedule
            function (default: ``"gpipe"``, fill-drain).
        virtual_stages (int): virtual stages per stage ``v`` (default: 1).
        workspace_bytes: ``w``, bytes one micro-batch's backward needs on a part beyond what
            its forward kept; a scalar, ``K`` values (every part of a stage) or ``K·v`` values
            (default: 0).
        output_bytes (float): ``o``, bytes per sample of the last part's output, the loss's
            input (default: 0).

    Returns:
        list[float]: peak bytes per stage, shape ``(K,)``.

    Raises:
        TypeError: a count is not an ``int``.
        ValueError: a count below 1, a negative or non-finite size, a list of the wrong
            length, an unknown ``checkpoint`` or ``schedule``, a ``virtual_stages`` the
            schedule cannot run.
    """
    check_count("stages", stages)
    check_count("virtual_stages", virtual_stages)
    sizes = microbatch_sizes(batch_size, chunks)
    v = virtual_stages
    a = _per_part("activation_bytes", activation_bytes, stages, v, split=True)
    b = _per_part("input_bytes", input_bytes, stages, v, split=False)
    w = _per_part("workspace_bytes", workspace_bytes, stages, v, split=False)
    _check_value("output_bytes", output_bytes)
    recompute = recomputed(checkpoint, len(sizes))
    grid = _grid(schedule, stages, len(sizes), v)
    whole_batch = schedule in ("gpipe", schedule_module.fill_drain)  # one training_step per mini-batch
    last = stages * v - 1
    peaks = []
    for k in range(stages):
        column = schedule_module.stage_actions(grid, k)
        held = peak = loss_alive = 0.0
        split = _split(column, k, stages, recompute)
        for action in column:
            c, i = schedule_module.part(k, action.virtual_stage, stages), action.i
            kept = (b[c] if recompute[i] else a[c]) * sizes[i]
            if action.kind == "W":
                held -= kept if (i, c) in split else 0.0  # a split backward's graph lives until its W
            elif action.kind == "F":
                held += kept
                if c == last and not whole_batch:
                    loss_alive = 0.0  # a new call: the last one's loss is let go
            else:
                loss_side = 2 * output_bytes * (sum(sizes) if whole_batch else sizes[i]) if c == last else 0.0
                rematerialized = a[c] * sizes[i] if recompute[i] else 0.0
                others = loss_side if c == last else loss_alive
                peak = max(peak, held + rematerialized + w[c] + others)
                held -= 0.0 if (i, c) in split else kept
                loss_alive = loss_side if c == last else loss_alive
            peak = max(peak, held + loss_alive)
        peaks.append(peak)
    return peaks


def _split(
    column: Sequence[Action], stage: int, stages: int, recompute: Sequence[bool]
) -> set[tuple[int, int]]:
    """``(micro-batch, part)`` of the backwards that ``column`` splits into ``B`` and ``W``: those with a
    ``W`` of their own, unless recomputed (:mod:`lightning_gpipe.engine.backward_split`). (The first stage
    runs its backwards whole, as its input needs no gradient; under ``"zb_h1"`` its ``W`` follows its
    ``B`` at once, so the times are the same.)"""
    return {
        (a.i, schedule_module.part(stage, a.virtual_stage, stages))
        for a in column
        if a.kind == "W" and not recompute[a.i]
    }


def simulate(
    stages: int,
    chunks: int,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    *,
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    checkpoint: str = "except_last",
    weight_backward: float | Sequence[float] | None = None,
    latency: float = 0.0,
    bandwidth: float = math.inf,
    boundary_bytes: float | Sequence[float] = 0.0,
    batch_size: int | None = None,
    activation_bytes: float | Sequence[float] = 0.0,
    input_bytes: float | Sequence[float] = 0.0,
    workspace_bytes: float | Sequence[float] = 0.0,
    output_bytes: float = 0.0,
    timeline: bool = False,
) -> Simulation:
    """Plays one training step of a schedule through the cost model of the module docstring.

    Args:
        stages (int): number of stages ``K``.
        chunks (int): number of micro-batches ``M`` (``min(M, N)`` are played when a
            ``batch_size`` ``N`` is given).
        forward: seconds of one micro-batch's forward on each stage (all its virtual stages
            together); a scalar or ``K`` values, or ``K·v`` values, one per part.
        backward: seconds of one micro-batch's backward (without recompute) on each stage;
            a scalar, ``K`` values or ``K·v`` values, as ``forward``.
        schedule: a name in :data:`~lightning_gpipe.schedule.SCHEDULES` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``, …) or a schedule function (default: ``"gpipe"``, fill-drain).
        virtual_stages (int): virtual stages per stage ``v`` (default: 1).
        checkpoint (str): re-materialization, ``"always"``, ``"except_last"`` or ``"never"``
            (default: ``"except_last"``). A re-materialized micro-batch's backward is
            preceded by a recompute as long as its forward.
        weight_backward: seconds of the weight-gradient part of ``backward``, which a schedule
            with ``W`` actions (``"zb_h1"``) runs apart: its ``B`` takes ``backward -
            weight_backward``, its ``W`` ``weight_backward``; a scalar, ``K`` or ``K·v`` values
            (default: half of ``backward``). A recomputed micro-batch's backward is not split
            (:mod:`lightning_gpipe.engine.backward_split`): whole at its ``B``, and its ``W`` takes no time.
            The model splits every other backward; the executor keeps one backward for a few
            more (module backward hooks, a compiled stage, a weight that reaches an output
            without the input chain), and the split's own costs (the graph walk, the gradients
            recorded until ``W``) are not modelled. The drain's split under the other schedules
            is not modelled.
        latency (float): seconds from the end of a transfer on a link to its arrival
            (default: 0).
        bandwidth (float): bytes per second of each link and direction (default: infinite).
        boundary_bytes: bytes of one micro-batch's activation (and of its gradient) at each
            boundary between parts; a scalar or ``K·v-1`` values (default: 0).
        batch_size (int | None): mini-batch size ``N``; needed for the memory estimate
            (default: None, no estimate).
        activation_bytes: per sample, bytes a stage keeps for backward without
            re-materialization; a scalar, ``K`` or ``K·v`` values (see
            :func:`peak_activation_memory`; default: 0).
        input_bytes: per sample, bytes of a part's boundary input; a scalar, ``K`` or ``K·v``
            values (default: 0).
        workspace_bytes: bytes one micro-batch's backward needs on a part beyond what its
            forward kept; a scalar, ``K`` or ``K·v`` values (see :func:`peak_activation_memory`;
            default: 0).
        output_bytes (float): per sample, bytes of the last part's output, the loss's input
            (default: 0).
        timeline (bool): also return every stage's events (default: False).

    Returns:
        Simulation: step time, bubble share, busy time, peak activation bytes, timeline.

    Raises:
        TypeError: ``stages``, ``chunks``, ``virtual_stages`` or ``batch_size`` is not an ``int``.
        ValueError: a count below 1, a negative or non-finite time or size, a list of the
            wrong length, ``bandwidth <= 0``, an unknown ``checkpoint`` or ``schedule``, a
            ``virtual_stages`` the schedule cannot run, or a
            ``weight_backward`` above ``backward``.

    Example:
        >>> sim = simulate(4, 8, forward=1.0, backward=2.0, checkpoint="never")
        >>> sim.step_time, round(sim.bubble, 4)
        (33.0, 0.2727)
        >>> sim = simulate(4, 8, 1.0, 2.0, schedule="interleaved_1f1b", virtual_stages=2, checkpoint="never")
        >>> sim.step_time, round(sim.bubble, 4)
        (28.5, 0.1579)
    """
    check_count("stages", stages)
    check_count("chunks", chunks)
    check_count("virtual_stages", virtual_stages)
    m = chunks if batch_size is None else len(microbatch_sizes(batch_size, chunks))
    v, parts = virtual_stages, stages * virtual_stages
    f = _per_part("forward", forward, stages, v, split=True)
    bw = _per_part("backward", backward, stages, v, split=True)
    if weight_backward is None:
        wb = [x / 2 for x in bw]
    else:
        wb = _per_part("weight_backward", weight_backward, stages, v, split=True)
        if any(x > y for x, y in zip(wb, bw)):
            raise ValueError(
                f"weight_backward must not exceed backward (weight_backward: {weight_backward!r})"
            )
    size = _per_stage("boundary_bytes", boundary_bytes, parts - 1)
    _check_value("latency", latency)
    if not (bandwidth > 0):
        raise ValueError(f"bandwidth must be positive bytes per second (got {bandwidth})")
    recompute = recomputed(checkpoint, m)
    transfer = [s / bandwidth if s > 0 else 0.0 for s in size]

    grid = _grid(schedule, stages, m, v)
    columns = [schedule_module.stage_actions(grid, j) for j in range(stages)]
    split = set().union(*(_split(column, j, stages, recompute) for j, column in enumerate(columns)))
    events: list[list[Event]] = [[] for _ in range(stages)]
    free = [0.0] * stages  # when each stage finishes its current work
    link_free: dict[tuple[int, int], float] = {}  # (from stage, to stage): when the link is free
    arrived: dict[tuple[str, int, int], float] = {  # (kind, i, part): its input is ready on its stage
        ("F", i, 0): 0.0 for i in range(m)
    }
    next_action = [0] * stages

    def finish(action: Action, j: int, ready: float) -> None:
        """Stage j finished ``action`` at ``ready``; deliver what it sends (:func:`.schedule.sends`)."""
        c = schedule_module.part(j, action.virtual_stage, stages)
        if action.kind == "F" and c == parts - 1:  # the loss of micro-batch i is known
            arrived[("B", action.i, c)] = ready
        if action.kind == "B":
            arrived[("W", action.i, c)] = ready
        for t in schedule_module.sends(action, j, stages, virtual_stages=v):
            other = schedule_module.part(t.peer, t.virtual_stage, stages)
            boundary = min(c, other)
            start = max(ready, link_free.get((j, t.peer), 0.0))
            link_free[(j, t.peer)] = start + transfer[boundary]
            arrived[(action.kind, action.i, other)] = start + transfer[boundary] + latency

    remaining = sum(len(column) for column in columns)
    while remaining:
        progressed = False
        for j in range(stages):
            while next_action[j] < len(columns[j]):
                action = columns[j][next_action[j]]
                kind, i, u = action.kind, action.i, action.virtual_stage
                c = schedule_module.part(j, u, stages)
                ready = arrived.get((kind, i, c))
                if ready is None:
                    break  # waits for another stage
                start = max(free[j], ready)
                if kind == "B" and recompute[i]:
                    events[j].append(Event("R", i, start, start + f[c], u))
                    start += f[c]
                if kind == "F":
                    end = start + f[c]
                elif (i, c) in split:
                    end = start + (bw[c] - wb[c] if kind == "B" else wb[c])
                else:
                    end = start + (bw[c] if kind == "B" else 0.0)
                events[j].append(Event(kind, i, start, end, u))
                free[j] = end
                finish(action, j, end)
                next_action[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - a valid schedule cannot deadlock
            raise RuntimeError(f"schedule deadlocked with {remaining} actions left")

    step_time = max(free)
    busy = [sum(e.end - e.start for e in stage_events) for stage_events in events]
    bubble = 1.0 - sum(busy) / (stages * step_time) if step_time > 0 else 0.0
    memory = None
    if batch_size is not None:
        memory = peak_activation_memory(
            stages,
            chunks,
            batch_size,
            activation_bytes,
            input_bytes,
            checkpoint,
            schedule=schedule,
            virtual_stages=v,
            workspace_bytes=workspace_bytes,
            output_bytes=output_bytes,
        )
    return Simulation(
        step_time=step_time,
        bubble=bubble,
        busy=busy,
        peak_activation_bytes=memory,
        timeline=events if timeline else None,
    )


def _grid(schedule: str | Schedule, stages: int, chunks: int, virtual_stages: int) -> Grid:
    """The grid of ``schedule`` (a name in :data:`~lightning_gpipe.schedule.SCHEDULES` or a function)."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule (schedule: {schedule!r}); choose one of {', '.join(map(repr, SCHEDULES))}"
            )
        schedule = SCHEDULES[schedule]
    return schedule(stages, chunks, virtual_stages)


def _check_value(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and non-negative (got {value})")


def _per_part(
    name: str, value: float | Sequence[float], stages: int, virtual_stages: int, *, split: bool
) -> list[float]:
    """One value per part ``c`` (stage ``c mod K``'s virtual stage ``c // K``).

    A scalar or ``K`` values (one per stage) give each of a stage's parts the stage's value,
    divided by ``v`` when ``split`` (a time or a size the stage's parts share); ``K·v`` values
    are the parts' own.
    """
    parts = stages * virtual_stages
    if isinstance(value, (int, float)) or virtual_stages == 1 or len(value) != parts:
        try:
            per_stage = _per_stage(name, value, stages)
        except ValueError:
            if virtual_stages == 1:
                raise
            raise ValueError(
                f"{name} needs {stages} values (one per stage) or {parts} (one per part) (got {len(value)})"  # type: ignore[arg-type]
            ) from None
        share = virtual_stages if split else 1
        return [per_stage[c % stages] / share for c in range(parts)]
    return _per_stage(name, value, parts)


def _per_stage(name: str, value: float | Sequence[float], length: int) -> list[float]:
    """A scalar broadcast to ``length`` values, or a sequence checked to be ``length`` long."""
    if isinstance(value, (int, float)):
        values = [float(value)] * length
    else:
        values = [float(v) for v in value]
        if len(values) != length:
            raise ValueError(f"{name} needs {length} values, one per stage or boundary (got {len(values)})")
    for v in values:
        _check_value(name, v)
    return values
