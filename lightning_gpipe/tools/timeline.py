"""Per-stage event record of the pipeline, and the bubble share per step.

Each rank keeps a :class:`Timeline`; :class:`~lightning_gpipe.engine.stage.PipelineStage` calls
``timeline.span(kind, i, u)`` around its forward, recompute, backward, send and receive of
micro-batch ``i`` on its virtual stage ``u`` (0 without virtual stages; ``"recompute"`` runs
inside ``"backward"``; a backward split in two, :mod:`lightning_gpipe.engine.backward_split`, records its
second pass as ``"weights"``), and the strategy marks the step
boundaries: a *step* runs from the start of ``training_step`` (the forward fill) to the end of
the backward drain. Times are ``time.perf_counter`` seconds, a clock that all processes of one
host share.

Bubble share (GPipe, Huang et al. 2019, arXiv 1811.06965, section 2.3): the idle share of stage
time in a step. A stage is busy while it computes a forward or a backward (recompute and weights included);
receiving, sending and waiting are idle. Over the K stages of a pipeline, a step's window runs
from the first forward's start to the last backward's end among them (a stage that enters the
step early only waits for the previous step's drain and optimizer step elsewhere; that wait is
not this step's schedule), and

    bubble = 1 - sum_k busy_k / (K · window)

which is ``(K-1)/(M+K-1)`` for equal stages and free communication under fill-drain and 1F1B,
and ``(K-1)/(v·M+K-1)`` under interleaved 1F1B with ``v`` virtual stages per stage
(:func:`lightning_gpipe.schedule.ideal_bubble`). A stage's own bubble is its idle share of that
window, ``1 - busy_k / window`` (:attr:`StepStats.stage_bubble`); its virtual stages' work
counts together, as they share one device.

After training, :func:`gather` brings every rank's record to global rank 0 (one
``gather_object``), where :func:`step_stats` combines them per step;
:mod:`lightning_gpipe.tools.trace` writes them as a Chrome trace and a Gantt chart.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = [
    "BUSY",
    "KINDS",
    "LETTERS",
    "Span",
    "StepStats",
    "Timeline",
    "gather",
    "mean_bubble_per_step",
    "step_stats",
]

KINDS = ("forward", "recompute", "backward", "weights", "send", "recv")
Span = tuple[str, int, float, float, int]  # (kind, micro-batch, start, end, virtual stage)
BUSY = ("forward", "backward", "weights")  # recompute runs inside backward
LETTERS = {
    "forward": "F",
    "recompute": "R",
    "backward": "B",
    "weights": "W",
    "send": "S",
    "recv": "V",
}  # trace labels


class _Span:
    """Context manager appending ``(kind, i, start, end, u)`` to an open step's events."""

    __slots__ = ("_timeline", "_kind", "_i", "_u", "_start")

    def __init__(self, timeline: Timeline, kind: str, i: int, u: int) -> None:
        self._timeline, self._kind, self._i, self._u = timeline, kind, i, u
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = self._timeline.clock()

    def __exit__(self, *exc: object) -> None:
        self._timeline._add(self._kind, self._i, self._start, self._timeline.clock(), self._u)


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()


class Timeline:
    """One rank's record of its stage's work, step by step.

    Every completed step keeps a summary ``(index, step, start, end, busy, first, last)``: seconds
    of the step's begin and end, of computing, and of its first compute's start and last compute's
    end (``start``/``end`` without compute); the events
    (``(kind, micro-batch, start, end, virtual stage)``, seconds) of the last ``keep_steps``
    steps are kept for the trace and the Gantt chart. Spans outside an open step (validation,
    prediction) are not recorded.

    Args:
        stage: this rank's stage index ``j``.
        stages: stages per pipeline K.
        rank: global rank.
        replica: data-parallel replica of this rank's pipeline.
        keep_steps: steps whose events are kept (default: 100).
        clock: seconds; ``time.perf_counter`` by default.
        virtual_stages: virtual stages v this stage holds (default: 1); its virtual stage ``u``
            runs the model's part ``j + u·K``.
        schedule: the schedule's name, for the chart's title and the ideal bubble (default:
            ``"gpipe"``).
    """

    def __init__(
        self,
        stage: int = 0,
        stages: int = 1,
        rank: int = 0,
        replica: int = 0,
        keep_steps: int = 100,
        clock: Callable[[], float] = time.perf_counter,
        virtual_stages: int = 1,
        schedule: str = "gpipe",
    ) -> None:
        self.stage, self.stages, self.rank, self.replica = stage, stages, rank, replica
        self.virtual_stages, self.schedule = virtual_stages, schedule
        self.clock = clock
        self.summaries: list[tuple[int, int, float, float, float, float, float]] = []
        self.events: deque[tuple[int, list[Span]]] = deque(maxlen=max(keep_steps, 0))
        self._open: list[Span] | None = None
        self._start = 0.0
        self._step = 0
        self._busy = 0.0
        self._first: float | None = None
        self._last = 0.0

    def begin_step(self, step: int = 0) -> None:
        """Open a step (``step``: the trainer's ``global_step``); an unfinished open step is dropped."""
        self._open, self._step, self._busy, self._first = [], step, 0.0, None
        self._start = self.clock()

    def end_step(self) -> None:
        """Close the open step (a no-op if none is open)."""
        if self._open is None:
            return
        index, end = len(self.summaries), self.clock()
        first, last = (self._start, end) if self._first is None else (self._first, self._last)
        self.summaries.append((index, self._step, self._start, end, self._busy, first, last))
        if self.events.maxlen:
            self.events.append((index, self._open))
        self._open = None

    def span(self, kind: str, i: int, u: int = 0) -> Any:
        """A context manager recording ``kind`` (one of :data:`KINDS`) of micro-batch ``i`` on
        virtual stage ``u``."""
        return _Span(self, kind, i, u) if self._open is not None else _NULL

    def _add(self, kind: str, i: int, start: float, end: float, u: int = 0) -> None:
        if self._open is None:
            return
        self._open.append((kind, i, start, end, u))
        if kind in BUSY:
            self._busy += end - start
            if self._first is None:
                self._first = start
            self._last = end

    def bubble(self) -> list[float]:
        """This stage's idle share per completed step, over its own step window (no communication)."""
        return [
            1.0 - busy / (end - start) if end > start else 0.0
            for _, _, start, end, busy, *_ in self.summaries
        ]

    def record(self) -> dict[str, Any]:
        """Everything recorded, as plain data (picklable, JSON-able)."""
        return {
            "stage": self.stage,
            "stages": self.stages,
            "rank": self.rank,
            "replica": self.replica,
            "virtual_stages": self.virtual_stages,
            "schedule": self.schedule,
            "summaries": list(self.summaries),
            "events": {index: events for index, events in self.events},
        }


def gather(timeline: Timeline, dst: int = 0) -> list[dict[str, Any]] | None:
    """Every rank's :meth:`Timeline.record` on rank ``dst`` (a collective: call it on every rank).

    Ranks on another host than ``dst`` get their times shifted onto ``dst``'s clock, estimated
    right after a barrier (error: the barrier's exit skew). Without an initialized process group
    the local record is returned alone.

    Returns:
        list of records, one per rank in rank order, on ``dst``; ``None`` on the other ranks.
    """
    record = timeline.record()
    if not (dist.is_available() and dist.is_initialized()):
        return [record]
    dist.barrier()
    record["clock"] = (socket.gethostname(), timeline.clock())
    records: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(record, records if dist.get_rank() == dst else None, dst=dst)
    if dist.get_rank() != dst:
        return None
    host, now = records[dst]["clock"]
    for rec in records:
        other_host, other_now = rec.pop("clock")
        if other_host != host:
            _shift(rec, now - other_now)
    return records


def _shift(record: dict[str, Any], offset: float) -> None:
    record["summaries"] = [
        (n, s, a + offset, b + offset, busy, f + offset, e + offset)
        for n, s, a, b, busy, f, e in record["summaries"]
    ]
    record["events"] = {
        index: [(k, i, a + offset, b + offset, u) for k, i, a, b, u in events]
        for index, events in record["events"].items()
    }


@dataclass(frozen=True)
class StepStats:
    """One step of one pipeline, combined over its stages.

    Attributes:
        index: completed-step counter (the same step on every rank).
        step: the trainer's ``global_step`` when the step began.
        replica: the pipeline (data-parallel replica).
        start: the first forward's start on any stage, seconds (``perf_counter``).
        window: seconds from there to the last backward's end on any stage.
        busy: seconds each stage computed, shape ``(K,)``, stage order.
        bubble: ``1 - sum(busy) / (K · window)``.
        schedule: the schedule's name (the records' ``"schedule"``, ``"gpipe"`` if absent).
        virtual_stages: v, virtual stages per stage (the records' ``"virtual_stages"``, 1 if absent).
    """

    index: int
    step: int
    replica: int
    start: float
    window: float
    busy: tuple[float, ...]
    bubble: float
    schedule: str = "gpipe"
    virtual_stages: int = 1

    @property
    def stage_bubble(self) -> tuple[float, ...]:
        """Each stage's idle share of the common window, ``1 - busy_k / window``, shape ``(K,)``
        (all of a stage's virtual stages together)."""
        return tuple(1.0 - b / self.window if self.window > 0 else 0.0 for b in self.busy)


def step_stats(records: Sequence[dict[str, Any]]) -> list[StepStats]:
    """Combine gathered records per pipeline and step (steps every stage of the pipeline completed)."""
    by_replica: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        by_replica.setdefault(rec["replica"], []).append(rec)
    stats = []
    for replica, recs in sorted(by_replica.items()):
        recs = sorted(recs, key=lambda r: r["stage"])
        k = len(recs)
        for rows in zip(*(r["summaries"] for r in recs)):
            start = min(row[5] for row in rows)
            window = max(row[6] for row in rows) - start
            busy = tuple(row[4] for row in rows)
            bubble = 1.0 - sum(busy) / (k * window) if window > 0 else 0.0
            stats.append(
                StepStats(
                    rows[0][0],
                    rows[0][1],
                    replica,
                    start,
                    window,
                    busy,
                    bubble,
                    schedule=str(recs[0].get("schedule", "gpipe")),
                    virtual_stages=int(recs[0].get("virtual_stages", 1)),
                )
            )
    return stats


def mean_bubble_per_step(records: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(global_step, bubble)`` pairs, the bubble averaged over pipelines and over the steps
    that began at the same ``global_step`` (gradient accumulation)."""
    values: dict[int, list[float]] = {}
    for s in step_stats(records):
        values.setdefault(s.step, []).append(s.bubble)
    return [(step, statistics.fmean(v)) for step, v in sorted(values.items())]
