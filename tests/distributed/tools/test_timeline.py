"""The timeline: bubble share, Chrome-trace export and Gantt chart, by hand and under the strategy."""

from __future__ import annotations

import csv
import json

import pytest

from tests._harness import check, run_ranks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_strategy_logs_bubble_and_writes_trace_and_gantt(tmp_path):
    """GPipeStrategy(timeline=True), 2 stages, 4 steps: pipeline/bubble per step in the CSV log, trace,
    PNG."""
    for result in run_ranks("tests/workers/timeline_fit.py", 2, str(tmp_path), "4", timeout=100):
        check(result)
    (metrics,) = tmp_path.glob("csv/**/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("pipeline/bubble")]
    assert sorted(int(r["step"]) for r in rows) == [0, 1, 2, 3]
    assert all(0.0 < float(r["pipeline/bubble"]) < 1.0 for r in rows)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"step", "forward", "recompute", "backward", "send", "recv"}
    assert len({e["pid"] for e in spans}) == 2
    forwards = [e for e in spans if e["cat"] == "forward" and e["args"]["step"] == 3]
    assert sorted(e["args"]["micro_batch"] for e in forwards) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_MAGIC
