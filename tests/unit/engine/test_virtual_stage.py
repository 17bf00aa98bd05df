"""The executor with virtual stages: interleaved 1F1B columns run as they are printed, with one call per
micro-batch, and give the unpartitioned model's gradients; evaluation runs the forwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.stage import StageDone
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import format_grid, in_send_order, interleaved_1f1b, stage_actions
from lightning_gpipe.tools.timeline import Timeline, step_stats
from lightning_gpipe.tools.trace import chrome_trace
from lightning_gpipe.transport.layout import Layout
from tests.fakes import BlockingNetwork, Recorder, ThreadP2P, in_threads, micro_step
from tests.unit.engine.test_executor import _by_rank, _outcome, _received, _reference_grads


def _net(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(blocks)))


def _stages(seq, k, v, chunks, checkpoint, network):
    """K stages of ``seq`` cut into K·v equal parts, over ``network``, recording their actions."""
    stages = []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        balance, cpu = uniform_balance(len(seq), k * v), torch.device("cpu")
        stage = build_stage(seq, balance, Layout(k, k), rank, chunks, checkpoint, cpu, interleaved_1f1b)
        stage.p2p, stage.timeline = ThreadP2P(network, rank), Recorder()
        stages.append(stage)
    return stages


def _micro_step(seq, k, v, chunks, x, y, checkpoint):
    """One training step with one call per micro-batch, as the strategy drives it
    (:func:`~tests.fakes.micro_step`: the last stage's loss each micro-batch's mean squared error)."""
    stages = _stages(seq, k, v, chunks, checkpoint, BlockingNetwork())
    counts = {}

    def body(stage):
        micro_step(stage, (x, y), lambda b: nn.functional.mse_loss(stage(b[0]), b[1]))
        counts[stage.topology.stage] = stage.p2p.phase()

    in_threads(stages, body)
    return stages, counts


@pytest.mark.parametrize(
    ("k", "v", "m"),
    [(2, 2, 1), (2, 2, 3), (2, 2, 4), (2, 2, 5), (2, 2, 8), (3, 2, 4), (3, 2, 5), (2, 3, 7), (4, 2, 8)],
)
def test_interleaved_columns_run_as_printed_and_give_the_plain_gradients(k, v, m):
    """Batch 10 (micro-batches of unequal sizes). (2, 2, 5) and (2, 3, 7) have an odd micro-batch
    group: their stages take each other's messages out of send order, so sends wait their turn."""
    seq = _net(k * v)
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    expected = _reference_grads(seq, x, y)
    checkpoint = ["always", "except_last", "never"][m % 3]
    stages, counts = _micro_step(seq, k, v, m, x, y, checkpoint)
    grid = interleaved_1f1b(k, min(m, 10), v)
    assert in_send_order(grid) == ((k, v, m) not in {(2, 2, 5), (2, 3, 7)})
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        assert stage.virtual_stages == v
        column = stage_actions(grid, j)
        assert stage.timeline.actions == [str(a) for a in column], f"stage {j}\n{format_grid(grid)}"
        received = _by_rank(top, _received(column, j, k, top.skips, virtual_stages=v))
        assert counts[j] == received + _outcome(top)
    for p, g in zip(seq.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("k", "v", "m"), [(2, 2, 4), (2, 2, 5), (3, 2, 3)])
def test_evaluation_runs_every_virtual_stage_forward(k, v, m):
    seq = _net(k * v)
    x = torch.randn(7, 4)
    stages = _stages(seq, k, v, m, "never", BlockingNetwork())
    outputs = {}

    def body(stage):
        with torch.no_grad():
            outputs[stage.topology.stage] = stage.run_step(stage, False, x)

    in_threads(stages, body)
    assert all(outputs[j] is StageDone for j in range(k - 1))
    with torch.no_grad():
        torch.testing.assert_close(outputs[k - 1], seq(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("k", "v", "m"), [(2, 2, 4), (3, 2, 5)])
def test_timeline_spans_carry_the_virtual_stage_and_give_each_stages_bubble(k, v, m):
    """A real Timeline on every stage of an interleaved step: each stage's forward and backward
    spans are its column's actions with their virtual stages, in order; the trace names them
    F{i}v{u}; the bubble and each stage's idle share come out of the window, in [0, 1)."""
    seq = _net(k * v)
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    stages = _stages(seq, k, v, m, "except_last", BlockingNetwork())
    for stage in stages:
        j = stage.topology.stage
        stage.timeline = Timeline(j, k, k - 1 - j, virtual_stages=v, schedule="interleaved_1f1b")

    def body(stage):
        stage.timeline.begin_step(0)
        micro_step(stage, (x, y), lambda b: nn.functional.mse_loss(stage(b[0]), b[1]))
        stage.timeline.end_step()

    in_threads(stages, body)
    grid = interleaved_1f1b(k, m, v)
    records = [stage.timeline.record() for stage in stages]
    for j, record in enumerate(records):
        done = [
            (kind[0].upper(), i, u)
            for kind, i, _, _, u in record["events"][0]
            if kind in ("forward", "backward")
        ]
        assert done == [(a.kind, a.i, a.virtual_stage) for a in stage_actions(grid, j)], f"stage {j}"
        recomputed = {(i, u) for kind, i, _, _, u in record["events"][0] if kind == "recompute"}
        assert recomputed == {(i, u) for i in range(m - 1) for u in range(v)}, f"stage {j}"
    (stats,) = step_stats(records)
    assert (stats.schedule, stats.virtual_stages, len(stats.stage_bubble)) == ("interleaved_1f1b", v, k)
    assert 0.0 <= stats.bubble < 1.0 and all(0.0 <= b < 1.0 for b in stats.stage_bubble)
    assert stats.bubble == pytest.approx(sum(stats.stage_bubble) / k)
    names = {e["name"] for e in chrome_trace(records)["traceEvents"] if e.get("cat") == "forward"}
    assert names == {f"F{i}v{u}" for i in range(m) for u in range(v)}
