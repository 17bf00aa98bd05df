"""The timeline: bubble share, Chrome-trace export and Gantt chart, by hand and under the strategy."""

from __future__ import annotations

import json

import pytest

from lightning_gpipe.schedule import ideal_bubble
from lightning_gpipe.tools.simulate import simulate
from lightning_gpipe.tools.timeline import Timeline, mean_bubble_per_step, step_stats
from lightning_gpipe.tools.trace import chrome_trace, plot_gantt, write_chrome_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


_KIND = {"F": "forward", "B": "backward", "R": "recompute", "W": "weights"}


def records_from_simulation(
    stages: int,
    chunks: int,
    checkpoint: str = "never",
    steps: int = 1,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    latency: float = 0.25,
):
    """Gathered-timeline records of a simulated step (K stages, v virtual stages each), as the
    strategy would produce.

    The stage's recompute runs inside its backward span, as in the engine.
    """
    sim = simulate(
        stages,
        chunks,
        forward=1.0,
        backward=2.0,
        checkpoint=checkpoint,
        latency=latency,
        timeline=True,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )
    assert sim.timeline is not None
    records = []
    for j, events in enumerate(sim.timeline):
        recompute_start = {(e.microbatch, e.virtual_stage): e.start for e in events if e.kind == "R"}
        spans = []
        for e in events:
            start = (
                recompute_start.get((e.microbatch, e.virtual_stage), e.start) if e.kind == "B" else e.start
            )
            spans.append((_KIND[e.kind], e.microbatch, start, e.end, e.virtual_stage))
        busy = sum(b - a for kind, _, a, b, _ in spans if kind != "recompute")
        records.append(
            {
                "stage": j,
                "stages": stages,
                "rank": stages - 1 - j,
                "replica": 0,
                "virtual_stages": virtual_stages,
                "schedule": schedule,
                "summaries": [
                    (
                        n,
                        n,
                        n * 100.0 - 1.0,
                        n * 100.0 + sim.step_time + 1.0,
                        busy,
                        n * 100.0,
                        n * 100.0 + sim.step_time,
                    )
                    for n in range(steps)
                ],
                "events": {
                    n: [(k, i, a + n * 100.0, b + n * 100.0, u) for k, i, a, b, u in spans]
                    for n in range(steps)
                },
            }
        )
    return records, sim


@pytest.mark.parametrize("stages,chunks", [(2, 1), (2, 4), (4, 8)])
def test_bubble_of_simulated_steps_equals_the_cost_model(stages, chunks):
    records, sim = records_from_simulation(stages, chunks, steps=2)
    stats = step_stats(records)
    assert [s.index for s in stats] == [0, 1]
    assert stats[0].bubble == pytest.approx(sim.bubble)
    assert stats[0].window == pytest.approx(sim.step_time)
    assert mean_bubble_per_step(records) == [(0, pytest.approx(sim.bubble)), (1, pytest.approx(sim.bubble))]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
@pytest.mark.parametrize(("stages", "chunks"), [(2, 4), (3, 6), (4, 8)])
def test_bubble_per_stage_of_every_schedule_equals_the_cost_model(schedule, v, stages, chunks):
    """Each stage's idle share of the window is 1 - its busy time / the step (all its virtual
    stages together); with free communication the pipeline's bubble is the schedule's ideal
    (K-1)/(v·M+K-1), and ZB-H1's (K-1)(F+B-W)/((K-1)(F+B-W)+M(F+B+W)) with F = B = W = 1 s."""
    for latency in (0.25, 0.0):
        records, sim = records_from_simulation(
            stages, chunks, schedule=schedule, virtual_stages=v, latency=latency
        )
        (stats,) = step_stats(records)
        assert (stats.schedule, stats.virtual_stages) == (schedule, v)
        assert stats.bubble == pytest.approx(sim.bubble)
        assert stats.stage_bubble == pytest.approx([1 - b / sim.step_time for b in sim.busy])
        assert {u for r in records for *_, u in r["events"][0]} == set(range(v))
    if schedule == "zb_h1":
        assert stats.bubble == pytest.approx((stages - 1) / (stages - 1 + 3 * chunks))
    else:
        assert stats.bubble == pytest.approx(ideal_bubble(stages, chunks, v))


def test_chrome_trace_and_gantt_name_the_virtual_stage(tmp_path):
    """Interleaved K=2, v=2, M=4: every forward is named F{i}v{u} and carries its virtual stage;
    each stage runs M forwards on each of its v virtual stages; the Gantt chart draws the step."""
    records, _ = records_from_simulation(
        2, 4, checkpoint="except_last", schedule="interleaved_1f1b", virtual_stages=2
    )
    spans = [e for e in chrome_trace(records)["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    for pid in (0, 1):
        forwards = [e for e in spans if e["pid"] == pid and e["cat"] == "forward"]
        assert sorted(e["name"] for e in forwards) == sorted(f"F{i}v{u}" for i in range(4) for u in (0, 1))
        assert all(e["name"].endswith(f"v{e['args']['virtual_stage']}") for e in forwards)
    assert {e["name"] for e in spans if e["cat"] == "recompute"} == {
        f"R{i}v{u}" for i in range(3) for u in (0, 1)
    }
    gpipe, _ = records_from_simulation(2, 4)
    assert "F0" in {e["name"] for e in chrome_trace(gpipe)["traceEvents"]}  # no v without virtual stages
    assert plot_gantt(records, tmp_path / "interleaved.png").read_bytes()[:8] == PNG_MAGIC


def test_timeline_records_spans_only_inside_a_step_and_sums_busy_time():
    now = [0.0]
    timeline = Timeline(stage=0, stages=2, clock=lambda: now[0])
    with timeline.span("forward", 0):  # outside a step (e.g. validation): not recorded
        now[0] += 5.0
    timeline.begin_step(step=7)
    for kind, i, seconds in [("forward", 0, 1.0), ("send", 0, 0.5), ("recv", 0, 2.0), ("backward", 0, 1.5)]:
        with timeline.span(kind, i):
            now[0] += seconds
    now[0] += 1.0  # idle
    timeline.end_step()
    assert timeline.summaries == [(0, 7, 5.0, 11.0, 2.5, 5.0, 10.0)]
    assert timeline.bubble() == [pytest.approx(1 - 2.5 / 6.0)]
    assert [e[0] for e in timeline.record()["events"][0]] == ["forward", "send", "recv", "backward"]


def test_timeline_keeps_each_spans_virtual_stage_and_counts_both_as_busy():
    now = [0.0]
    timeline = Timeline(
        stage=1, stages=2, clock=lambda: now[0], virtual_stages=2, schedule="interleaved_1f1b"
    )
    timeline.begin_step(step=0)
    for kind, i, u, seconds in [("forward", 0, 0, 1.0), ("recv", 0, 1, 0.5), ("forward", 0, 1, 1.0)]:
        with timeline.span(kind, i, u):
            now[0] += seconds
    timeline.end_step()
    record = timeline.record()
    assert record["events"][0] == [
        ("forward", 0, 0.0, 1.0, 0),
        ("recv", 0, 1.0, 1.5, 1),
        ("forward", 0, 1.5, 2.5, 1),
    ]
    assert (record["virtual_stages"], record["schedule"]) == (2, "interleaved_1f1b")
    assert timeline.summaries == [(0, 0, 0.0, 2.5, 2.0, 0.0, 2.5)]


def test_chrome_trace_is_valid_json_with_one_process_per_stage(tmp_path):
    records, _ = records_from_simulation(3, 4, checkpoint="except_last")
    path = write_chrome_trace(records, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(chrome_trace(records)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["stage 0 · rank 2", "stage 1 · rank 1", "stage 2 · rank 0"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in names for e in spans)
    per_stage = {pid: [e for e in spans if e["pid"] == pid and e["cat"] == "forward"] for pid in names}
    assert all(len(v) == 4 for v in per_stage.values())
    # A recompute nests inside its backward on the same process (complete events must nest).
    for r in (e for e in spans if e["cat"] == "recompute"):
        (b,) = [
            e
            for e in spans
            if e["cat"] == "backward"
            and e["pid"] == r["pid"]
            and e["args"]["micro_batch"] == r["args"]["micro_batch"]
        ]
        assert b["ts"] <= r["ts"] and r["ts"] + r["dur"] <= b["ts"] + b["dur"] + 1e-3
    assert {e["name"] for e in spans if e["cat"] == "recompute"} == {"R0", "R1", "R2"}


def test_gantt_png_is_written(tmp_path):
    records, _ = records_from_simulation(2, 4, checkpoint="always")
    path = plot_gantt(records, tmp_path / "docs" / "gantt.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="no kept events"):
        plot_gantt(records, tmp_path / "none.png", index=5)
