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
estimate (:func:`~lightning_gpipe.tools.memory.peak_activation_memory`) plays the same columns.

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
from lightning_gpipe.schedule import Action, Schedule
from lightning_gpipe.schedule import sizes as microbatch_sizes
from lightning_gpipe.tools.memory import (
    check_value,
    grid_of,
    peak_activation_memory,
    per_part,
    per_stage,
    split_backwards,
)

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
    f = per_part("forward", forward, stages, v, split=True)
    bw = per_part("backward", backward, stages, v, split=True)
    if weight_backward is None:
        wb = [x / 2 for x in bw]
    else:
        wb = per_part("weight_backward", weight_backward, stages, v, split=True)
        if any(x > y for x, y in zip(wb, bw)):
            raise ValueError(
                f"weight_backward must not exceed backward (weight_backward: {weight_backward!r})"
            )
    size = per_stage("boundary_bytes", boundary_bytes, parts - 1)
    check_value("latency", latency)
    if not (bandwidth > 0):
        raise ValueError(f"bandwidth must be positive bytes per second (got {bandwidth})")
    recompute = recomputed(checkpoint, m)
    transfer = [s / bandwidth if s > 0 else 0.0 for s in size]

    grid = grid_of(schedule, stages, m, v)
    columns = [schedule_module.stage_actions(grid, j) for j in range(stages)]
    split = set().union(*(split_backwards(column, j, stages, recompute) for j, column in enumerate(columns)))
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
