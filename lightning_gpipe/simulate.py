"""Cost model of the GPipe fill-drain schedule: step time, bubble share, activation memory.

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
that formula: it plays each stage's column of :func:`lightning_gpipe.schedule.fill_drain` action
by action, with the transfers :func:`lightning_gpipe.schedule.sends` names and the recompute rule
of :mod:`lightning_gpipe.recompute` (the same data the stages execute), so unequal stages,
communication delays and re-materialization come out right.

Model, in seconds and bytes:

- compute: stage j's forward of one micro-batch takes ``forward[j]``, its backward
  ``backward[j]``; a re-materialized micro-batch first repeats the forward (``"R"``,
  ``forward[j]`` seconds) when its backward is due, after its gradient has arrived;
- communication: a micro-batch's activation (forward) or gradient (backward) crossing
  boundary j (between stages j and j+1) is ``boundary_bytes[j]`` bytes. Sends are
  asynchronous (the sender does not wait). One transfer at a time per link and direction:
  it occupies the link for ``bytes / bandwidth`` and arrives ``latency`` later;
- the loss is part of the last stage's forward time; the optimizer step is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_gpipe import schedule
from lightning_gpipe.microbatch import sizes as microbatch_sizes
from lightning_gpipe.recompute import recomputed
from lightning_gpipe.schedule import Action

__all__ = ["Event", "Simulation", "peak_activation_memory", "simulate"]


class Event(NamedTuple):
    """One stretch of work on a stage: ``kind`` is ``"F"`` (forward), ``"R"`` (recompute:
    the forward repeated before a backward) or ``"B"`` (backward); times in seconds from the
    start of the step."""

    kind: str
    microbatch: int
    start: float
    end: float


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
) -> list[float]:
    """Peak bytes of activations each stage holds for backward during one step.

    Stage k holds, per sample, ``activation_bytes[k]`` (``a_k``) for a micro-batch whose
    activations are kept, or only its boundary input ``input_bytes[k]`` (``b_k``) for a
    re-materialized one, which then needs its ``a_k`` again while its backward runs. The
    holdings are played through the schedule (forwards add, each backward frees its
    micro-batch) and the maximum is returned. With ``M`` equal micro-batches of ``N/M``:

    - ``"never"``: ``N·a_k`` — all activations of the mini-batch;
    - ``"always"``: ``N·b_k + (N/M)·a_k`` — the boundary inputs of all micro-batches plus
      one micro-batch's activations, GPipe's ``O(N + (L/K)·(N/M))``;
    - ``"except_last"``: ``(N - N/M)·b_k + (N/M)·a_k``.

    ``a_k`` is treated as the stage's inner activations; if it also counts the boundary
    input, the estimate with re-materialization is high by one micro-batch's input.

    Args:
        stages (int): number of stages ``K``.
        chunks (int): number of micro-batches ``M`` (fewer if ``N < M``).
        batch_size (int): mini-batch size ``N``.
        activation_bytes: ``a_k``, bytes per sample that stage k keeps for backward without
            re-materialization; a scalar or ``K`` values.
        input_bytes: ``b_k``, bytes per sample of stage k's input; a scalar or ``K`` values
            (default: 0).
        checkpoint (str): ``"always"``, ``"except_last"`` or ``"never"`` (default:
            ``"except_last"``).

    Returns:
        list[float]: peak bytes per stage, shape ``(K,)``.

    Raises:
        TypeError: a count is not an ``int``.
        ValueError: a count below 1, a negative or non-finite size, a list that is not ``K``
            long, or an unknown ``checkpoint``.
    """
    _check_count("stages", stages)
    sizes = microbatch_sizes(batch_size, chunks)
    a = _per_stage("activation_bytes", activation_bytes, stages)
    b = _per_stage("input_bytes", input_bytes, stages)
    recompute = recomputed(checkpoint, len(sizes))
    peaks = []
    for k in range(stages):
        held = peak = 0.0
        kept = [(b[k] if recompute[i] else a[k]) * n for i, n in enumerate(sizes)]
        for i in range(len(sizes)):  # forwards
            held += kept[i]
            peak = max(peak, held)
        for i in reversed(range(len(sizes))):  # backwards
            if recompute[i]:
                peak = max(peak, held + a[k] * sizes[i])
            held -= kept[i]
        peaks.append(peak)
    return peaks


def simulate(
    stages: int,
    chunks: int,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    *,
    checkpoint: str = "except_last",
    latency: float = 0.0,
    bandwidth: float = math.inf,
    boundary_bytes: float | Sequence[float] = 0.0,
    batch_size: int | None = None,
    activation_bytes: float | Sequence[float] = 0.0,
    input_bytes: float | Sequence[float] = 0.0,
    timeline: bool = False,
) -> Simulation:
    """Plays one GPipe training step through the cost model of the module docstring.

    Args:
        stages (int): number of stages ``K``.
        chunks (int): number of micro-batches ``M`` (``min(M, N)`` are played when a
            ``batch_size`` ``N`` is given).
        forward: seconds of one micro-batch's forward on each stage; a scalar or ``K``
            values.
        backward: seconds of one micro-batch's backward (without recompute) on each stage;
            a scalar or ``K`` values.
        checkpoint (str): re-materialization, ``"always"``, ``"except_last"`` or ``"never"``
            (default: ``"except_last"``). A re-materialized micro-batch's backward is
            preceded by a recompute as long as its forward.
        latency (float): seconds from the end of a transfer on a link to its arrival
            (default: 0).
        bandwidth (float): bytes per second of each link and direction (default: infinite).
        boundary_bytes: bytes of one micro-batch's activation (and of its gradient) at each
            boundary between stages; a scalar or ``K-1`` values (default: 0).
        batch_size (int | None): mini-batch size ``N``; needed for the memory estimate
            (default: None, no estimate).
        activation_bytes: per sample, bytes each stage keeps for backward without
            re-materialization; a scalar or ``K`` values (default: 0).
        input_bytes: per sample, bytes of each stage's boundary input; a scalar or ``K``
            values (default: 0).
        timeline (bool): also return every stage's events (default: False).

    Returns:
        Simulation: step time, bubble share, busy time, peak activation bytes, timeline.

    Raises:
        TypeError: ``stages``, ``chunks`` or ``batch_size`` is not an ``int``.
        ValueError: a count below 1, a negative or non-finite time or size, a list of the
            wrong length, ``bandwidth <= 0``, or an unknown ``checkpoint``.

    Example:
        >>> sim = simulate(4, 8, forward=1.0, backward=2.0, checkpoint="never")
        >>> sim.step_time, round(sim.bubble, 4)
        (33.0, 0.2727)
    """
    _check_count("stages", stages)
    _check_count("chunks", chunks)
    m = chunks if batch_size is None else len(microbatch_sizes(batch_size, chunks))
    f = _per_stage("forward", forward, stages)
    bw = _per_stage("backward", backward, stages)
    size = _per_stage("boundary_bytes", boundary_bytes, stages - 1)
    _check_value("latency", latency)
    if not (bandwidth > 0):
        raise ValueError(f"bandwidth must be positive bytes per second (got {bandwidth})")
    recompute = recomputed(checkpoint, m)
    transfer = [s / bandwidth if s > 0 else 0.0 for s in size]

    columns = [schedule.stage_actions(schedule.fill_drain(stages, m), j) for j in range(stages)]
    loss_known = schedule.split_phases(columns[-1])[0][-1]  # the last stage's forward phase is done
    events: list[list[Event]] = [[] for _ in range(stages)]
    free = [0.0] * stages  # when each stage finishes its current work
    # link_free[d][j]: when boundary j is free in direction d (0: forward j -> j+1, 1: back)
    link_free = [[0.0] * (stages - 1) for _ in range(2)]
    arrived: dict[tuple[Action, int], float] = {  # (action, stage j) -> its input is ready on stage j
        (a, j): 0.0
        for j, column in enumerate(columns)
        for a in column
        if not schedule.receives(a, j, stages) and not schedule.needs_loss(a, j, stages)
    }
    next_action = [0] * stages

    def send(action: Action, j: int, ready: float) -> None:
        """Stage j finished ``action`` at ``ready``; deliver what it sends (:func:`.schedule.sends`)."""
        for t in schedule.sends(action, j, stages):
            d, link = (0, j) if t.peer > j else (1, t.peer)
            start = max(ready, link_free[d][link])
            link_free[d][link] = start + transfer[link]
            arrived[(action, t.peer)] = start + transfer[link] + latency
        if j == stages - 1 and action == loss_known:  # the loss is known: the drain can start
            arrived.update({(a, j): ready for a in columns[j] if schedule.needs_loss(a, j, stages)})

    remaining = sum(len(column) for column in columns)
    while remaining:
        progressed = False
        for j in range(stages):
            while next_action[j] < len(columns[j]):
                action = columns[j][next_action[j]]
                kind, i = action.kind, action.i
                ready = arrived.get((action, j))
                if ready is None:
                    break  # waits for another stage
                start = max(free[j], ready)
                if kind == "B" and recompute[i]:
                    events[j].append(Event("R", i, start, start + f[j]))
                    start += f[j]
                end = start + (f[j] if kind == "F" else bw[j])
                events[j].append(Event(kind, i, start, end))
                free[j] = end
                send(action, j, end)
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
        memory = peak_activation_memory(stages, chunks, batch_size, activation_bytes, input_bytes, checkpoint)
    return Simulation(
        step_time=step_time,
        bubble=bubble,
        busy=busy,
        peak_activation_bytes=memory,
        timeline=events if timeline else None,
    )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (got {type(value).__name__}: {value!r})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (got {value})")


def _check_value(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and non-negative (got {value})")


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
