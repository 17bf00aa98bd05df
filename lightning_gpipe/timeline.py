"""Per-stage event record of the pipeline: bubble share, Chrome trace, Gantt chart.

Each rank keeps a :class:`Timeline`; :class:`~lightning_gpipe.stage.PipelineStage` calls
``timeline.span(kind, i)`` around its forward, recompute, backward, send and receive of
micro-batch ``i`` (``"recompute"`` runs inside ``"backward"``), and the strategy marks the step
boundaries: a *step* runs from the start of ``training_step`` (the forward fill) to the end of
the backward drain. Times are ``time.perf_counter`` seconds, a clock that all processes of one
host share.

Bubble share (GPipe, Huang et al. 2019, arXiv 1811.06965, section 2.3): the idle share of stage
time in a step. A stage is busy while it computes a forward or a backward (recompute included);
receiving, sending and waiting are idle. Over the K stages of a pipeline, a step's window runs
from the first forward's start to the last backward's end among them (a stage that enters the
step early only waits for the previous step's drain and optimizer step elsewhere; that wait is
not this step's schedule), and

    bubble = 1 - sum_k busy_k / (K · window)

which is ``(K-1)/(M+K-1)`` for equal stages and free communication
(:func:`lightning_gpipe.simulate.ideal_bubble`).

After training, :func:`gather` brings every rank's record to global rank 0 (one
``gather_object``), where :func:`step_stats` combines them per step, :func:`chrome_trace`
writes a trace for ``chrome://tracing`` / Perfetto (one process per stage) and
:func:`plot_gantt` draws one step like the GPipe paper's figure 2c.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "KINDS",
    "StepStats",
    "Timeline",
    "chrome_trace",
    "gather",
    "mean_bubble_per_step",
    "plot_gantt",
    "publish",
    "step_stats",
    "typical_step",
    "write_chrome_trace",
]

KINDS = ("forward", "recompute", "backward", "send", "recv")
_BUSY = ("forward", "backward")  # recompute runs inside backward
_LETTER = {"forward": "F", "recompute": "R", "backward": "B", "send": "S", "recv": "W"}


class _Span:
    """Context manager appending ``(kind, i, start, end)`` to an open step's events."""

    __slots__ = ("_timeline", "_kind", "_i", "_start")

    def __init__(self, timeline: Timeline, kind: str, i: int) -> None:
        self._timeline, self._kind, self._i = timeline, kind, i
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = self._timeline.clock()

    def __exit__(self, *exc: object) -> None:
        self._timeline._add(self._kind, self._i, self._start, self._timeline.clock())


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
    (``(kind, micro-batch, start, end)``, seconds) of the last ``keep_steps`` steps are kept for
    the trace and the Gantt chart. Spans outside an open step (validation, prediction) are not
    recorded.

    Args:
        stage: this rank's stage index ``j``.
        stages: stages per pipeline K.
        rank: global rank.
        replica: data-parallel replica of this rank's pipeline.
        keep_steps: steps whose events are kept (default: 100).
        clock: seconds; ``time.perf_counter`` by default.
    """

    def __init__(
        self,
        stage: int = 0,
        stages: int = 1,
        rank: int = 0,
        replica: int = 0,
        keep_steps: int = 100,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stage, self.stages, self.rank, self.replica = stage, stages, rank, replica
        self.clock = clock
        self.summaries: list[tuple[int, int, float, float, float, float, float]] = []
        self.events: deque[tuple[int, list[tuple[str, int, float, float]]]] = deque(maxlen=max(keep_steps, 0))
        self._open: list[tuple[str, int, float, float]] | None = None
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

    def span(self, kind: str, i: int) -> Any:
        """A context manager recording ``kind`` (one of :data:`KINDS`) of micro-batch ``i``."""
        return _Span(self, kind, i) if self._open is not None else _NULL

    def _add(self, kind: str, i: int, start: float, end: float) -> None:
        if self._open is None:
            return
        self._open.append((kind, i, start, end))
        if kind in _BUSY:
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
        index: [(k, i, a + offset, b + offset) for k, i, a, b in events]
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
    """

    index: int
    step: int
    replica: int
    start: float
    window: float
    busy: tuple[float, ...]
    bubble: float

    @property
    def stage_bubble(self) -> tuple[float, ...]:
        """Each stage's idle share of the common window, shape ``(K,)``."""
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
            stats.append(StepStats(rows[0][0], rows[0][1], replica, start, window, busy, bubble))
    return stats


def mean_bubble_per_step(records: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(global_step, bubble)`` pairs, the bubble averaged over pipelines and over the steps
    that began at the same ``global_step`` (gradient accumulation)."""
    values: dict[int, list[float]] = {}
    for s in step_stats(records):
        values.setdefault(s.step, []).append(s.bubble)
    return [(step, statistics.fmean(v)) for step, v in sorted(values.items())]


def chrome_trace(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A Chrome-trace (``chrome://tracing``, Perfetto) of the kept steps.

    One process per rank, named after its stage (sorted by replica, then stage); every step and
    every span is a complete (``"X"``) event with ``ts``/``dur`` in microseconds from the
    earliest recorded time. Span names: ``F3`` (forward of micro-batch 3), ``R3``, ``B3``,
    ``send 3``, ``recv 3``.
    """
    starts = [a for rec in records for events in rec["events"].values() for _, _, a, _ in events]
    starts += [row[2] for rec in records for row in rec["summaries"] if row[0] in rec["events"]]
    origin = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for rec in records:
        pid, stage, replica = rec["rank"], rec["stage"], rec["replica"]
        name = f"stage {stage}" + (f" (replica {replica})" if replica else "") + f" · rank {pid}"
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}})
        sort = replica * rec["stages"] + stage
        events.append(
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": sort}}
        )
        summaries = {row[0]: row for row in rec["summaries"]}
        for index, spans in sorted(rec["events"].items()):
            index, step, start, end, busy, *_ = summaries[index]
            events.append(
                {
                    "ph": "X",
                    "name": f"step {index}",
                    "cat": "step",
                    "pid": pid,
                    "tid": 0,
                    "ts": us(start),
                    "dur": us(end) - us(start),
                    "args": {"global_step": step, "busy_s": busy},
                }
            )
            for kind, i, a, b in spans:
                label = f"{_LETTER[kind]}{i}" if kind in _BUSY or kind == "recompute" else f"{kind} {i}"
                events.append(
                    {
                        "ph": "X",
                        "name": label,
                        "cat": kind,
                        "pid": pid,
                        "tid": 0,
                        "ts": us(a),
                        "dur": us(b) - us(a),
                        "args": {"micro_batch": i, "step": index},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records)))
    return path


def typical_step(records: Sequence[dict[str, Any]], replica: int = 0) -> int | None:
    """The kept step (index) with the median window of ``replica``'s pipeline; ``None`` if none is kept."""
    kept_per_stage = [set(r["events"]) for r in records if r["replica"] == replica]
    kept = set.intersection(*kept_per_stage) if kept_per_stage else set()
    stats = sorted(
        (s.window, s.index) for s in step_stats(records) if s.replica == replica and s.index in kept
    )
    return stats[len(stats) // 2][1] if stats else None


_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "recompute": "#DD8452", "comm": "#8C8C8C"}


def plot_gantt(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    index: int | None = None,
    replica: int = 0,
    title: str | None = None,
) -> Path:
    """Draw one step of one pipeline as a Gantt chart (GPipe paper, figure 2c) into a PNG.

    Stages are rows (stage 0 on top); each forward ``F i`` and backward ``B i`` is a box
    labelled with its micro-batch, a recompute ``R i`` is drawn inside its backward, sends and
    receives are thin grey bars under the boxes, and idle time is left blank. The right margin
    gives each stage's idle share; the title the pipeline's bubble against ``(K-1)/(M+K-1)``.

    Args:
        records: gathered records (:func:`gather`).
        path: the PNG to write.
        index: the step to draw (default: :func:`typical_step`).
        replica: which pipeline to draw (default: 0).
        title: the chart's title (default: K, M and the bubble shares).

    Raises:
        ValueError: no kept events for the requested step.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    recs = sorted((r for r in records if r["replica"] == replica), key=lambda r: r["stage"])
    if index is None:
        index = typical_step(records, replica)
    if index is None or any(index not in r["events"] for r in recs):
        raise ValueError(f"no kept events for step {index} of replica {replica}; record more steps")
    stats = next(s for s in step_stats(records) if s.replica == replica and s.index == index)
    k = len(recs)
    m = 1 + max((i for r in recs for _, i, _, _ in r["events"][index]), default=0)
    t0 = stats.start
    ms = 1e3
    fig, ax = plt.subplots(figsize=(11, 0.8 * k + 1.6))
    span = stats.window * ms
    for row, rec in enumerate(recs):
        y = k - 1 - row
        events = rec["events"][index]
        recomputed = {i: (a, b) for kind, i, a, b in events if kind == "recompute"}
        for kind, i, a, b in events:
            x, w = (a - t0) * ms, (b - a) * ms
            if kind in ("send", "recv"):
                ax.broken_barh([(x, w)], (y - 0.42, 0.1), facecolors=_COLORS["comm"])
                continue
            on_top = kind == "recompute"
            ax.broken_barh(
                [(x, w)],
                (y - 0.3, 0.7),
                facecolors=_COLORS[kind],
                edgecolors="white",
                linewidth=0.5,
                zorder=3 if on_top else 2,
            )
            if kind == "backward" and i in recomputed:  # label the part after the recompute
                x = max(x, (recomputed[i][1] - t0) * ms)
                w = (b - t0) * ms - x
            if w > span * 0.012:
                ax.text(
                    x + w / 2,
                    y + 0.05,
                    f"{_LETTER[kind]}{i}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    zorder=4,
                )
        ax.text(span * 1.01, y, f"idle {stats.stage_bubble[row]:.0%}", va="center", fontsize=8)
    ideal = (k - 1) / (m + k - 1)
    ax.set_title(
        title
        or f"GPipe step: K={k} stages, M={m} micro-batches, bubble {stats.bubble:.1%} (ideal {ideal:.1%})"
    )
    ax.set_yticks(range(k))
    ax.set_yticklabels([f"stage {rec['stage']}" for rec in reversed(recs)])
    ax.set_xlim(0, span * 1.1)
    ax.set_ylim(-0.6, k - 0.4)
    ax.set_xlabel("time in step (ms)")
    ax.legend(
        handles=[Patch(color=_COLORS[c], label=c if c != "comm" else "send/recv") for c in _COLORS],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if k < 3 else -0.15),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def publish(
    timeline: Timeline, out_dir: str | Path | None, loggers: Sequence[Any] = (), name: str = "timeline"
) -> list[dict[str, Any]] | None:
    """End of fit: gather to rank 0, log ``pipeline/bubble`` per step, write the trace and the chart.

    A collective (every rank calls it). On global rank 0: logs ``pipeline/bubble`` for every
    ``global_step`` to each logger, writes ``{out_dir}/{name}.json`` (Chrome trace) and
    ``{out_dir}/{name}.png`` (Gantt chart of a typical step) when ``out_dir`` is given, and
    returns the gathered records; ``None`` elsewhere.
    """
    records = gather(timeline)
    if records is None:
        return None
    for step, bubble in mean_bubble_per_step(records):
        if math.isfinite(bubble):
            for logger in loggers:
                logger.log_metrics({"pipeline/bubble": bubble}, step=step)
    for logger in loggers:
        logger.save()
    if out_dir is not None and any(r["events"] for r in records):
        write_chrome_trace(records, Path(out_dir) / f"{name}.json")
        plot_gantt(records, Path(out_dir) / f"{name}.png")
    return records
