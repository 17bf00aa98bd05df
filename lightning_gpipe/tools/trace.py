"""The recorded timeline as files: a Chrome trace, a Gantt chart of one step, both written after fit.

Input: the records :func:`lightning_gpipe.tools.timeline.gather` brings to global rank 0, one per rank.
:func:`chrome_trace` is a trace for ``chrome://tracing`` / Perfetto (one process per stage, every
forward, recompute, backward, send and receive a span); :func:`plot_gantt` draws the step with the
median window like the GPipe paper's figure 2c (Huang et al. 2019, arXiv 1811.06965);
:func:`publish` is what ``GPipeStrategy(timeline=True)`` runs at the end of ``fit``: gather, log
``pipeline/bubble`` per step, write both files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gpipe.schedule import ideal_bubble
from lightning_gpipe.tools.timeline import BUSY, LETTERS, Timeline, gather, mean_bubble_per_step, step_stats

__all__ = ["chrome_trace", "label", "plot_gantt", "publish", "typical_step", "write_chrome_trace"]


def label(kind: str, i: int, u: int, virtual_stages: int) -> str:
    """A span's name: ``F3`` (forward of micro-batch 3), ``R3``, ``B3``, ``send 3``, ``recv 3``;
    with virtual stages (``virtual_stages > 1``) its virtual stage follows, as in
    :func:`lightning_gpipe.schedule.format_grid`: ``F3v1``, ``send 3v1``."""
    name = f"{LETTERS[kind]}{i}" if kind in BUSY or kind == "recompute" else f"{kind} {i}"
    return name + (f"v{u}" if virtual_stages > 1 else "")


def chrome_trace(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A Chrome-trace (``chrome://tracing``, Perfetto) of the kept steps.

    One process per rank, named after its stage (sorted by replica, then stage); every step and
    every span is a complete (``"X"``) event with ``ts``/``dur`` in microseconds from the
    earliest recorded time. Span names: :func:`label` (``F3``, ``R3``, ``B3``, ``send 3``,
    ``recv 3``; ``F3v1`` … with virtual stages); each span's ``args`` give its ``micro_batch``,
    ``virtual_stage`` and ``step``.
    """
    starts = [a for rec in records for events in rec["events"].values() for _, _, a, _, _ in events]
    starts += [row[2] for rec in records for row in rec["summaries"] if row[0] in rec["events"]]
    origin = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for rec in records:
        pid, stage, replica = rec["rank"], rec["stage"], rec["replica"]
        v = rec.get("virtual_stages", 1)
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
            for kind, i, a, b, u in spans:
                events.append(
                    {
                        "ph": "X",
                        "name": label(kind, i, u, v),
                        "cat": kind,
                        "pid": pid,
                        "tid": 0,
                        "ts": us(a),
                        "dur": us(b) - us(a),
                        "args": {"micro_batch": i, "virtual_stage": u, "step": index},
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


_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "weights": "#8DC99B",
    "recompute": "#DD8452",
    "comm": "#8C8C8C",
}


def plot_gantt(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    index: int | None = None,
    replica: int = 0,
    title: str | None = None,
) -> Path:
    """Draw one step of one pipeline as a Gantt chart (GPipe paper, figure 2c) into a PNG.

    Stages are rows (stage 0 on top); each forward ``F i`` and backward ``B i`` is a box
    labelled with its micro-batch (and, with virtual stages, its virtual stage, ``F i v u``, the
    boxes of virtual stage ``u > 0`` hatched), a recompute ``R i`` is drawn inside its backward,
    sends and receives are thin grey bars under the boxes, and idle time is left blank. The right
    margin gives each stage's idle share; the title the schedule, the pipeline's bubble and the
    ideal ``(K-1)/(v·M+K-1)`` (:func:`lightning_gpipe.schedule.ideal_bubble`).

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
    m = 1 + max((i for r in recs for _, i, _, _, _ in r["events"][index]), default=0)
    v = stats.virtual_stages
    t0 = stats.start
    ms = 1e3
    fig, ax = plt.subplots(figsize=(11, 0.8 * k + 1.6))
    span = stats.window * ms
    for row, rec in enumerate(recs):
        y = k - 1 - row
        events = rec["events"][index]
        recomputed = {(i, u): (a, b) for kind, i, a, b, u in events if kind == "recompute"}
        for kind, i, a, b, u in events:
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
                hatch="//" if u % 2 else None,
                zorder=3 if on_top else 2,
            )
            if kind == "backward" and (i, u) in recomputed:  # label the part after the recompute
                x = max(x, (recomputed[i, u][1] - t0) * ms)
                w = (b - t0) * ms - x
            if w > span * 0.012:
                ax.text(
                    x + w / 2,
                    y + 0.05,
                    label(kind, i, u, v),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    zorder=4,
                )
        ax.text(span * 1.01, y, f"idle {stats.stage_bubble[row]:.0%}", va="center", fontsize=8)
    ideal = ideal_bubble(k, m, v)
    layout = f"K={k} stages" + (f" × v={v} virtual stages" if v > 1 else "")
    ax.set_title(
        title
        or f"{stats.schedule} step: {layout}, M={m} micro-batches, "
        f"bubble {stats.bubble:.1%} (ideal {ideal:.1%})"
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
