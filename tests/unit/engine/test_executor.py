"""The stage executor (:mod:`lightning_gpipe.engine.executor`): the schedule column it runs.

The executor tests run K stages in one process over a fake transport (no torch.distributed):
every stage's forward phase in stage order, the loss, every stage's backward phase in reverse
stage order. Sends never block, so this order completes any fill-drain step.
"""

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_gpipe import StageError
from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.skip import Pop, Stash
from lightning_gpipe.engine.stage import PipelineUsageError, StageDone
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import (
    fill_drain,
    format_grid,
    one_f_one_b,
    receives,
    stage_actions,
    zb_h1,
)
from lightning_gpipe.transport.layout import Layout
from tests.fakes import (
    BlockingNetwork,
    FakeNetwork,
    FakeP2P,
    Recorder,
    ThreadP2P,
    in_threads,
    micro_step,
    recorded,
)
from tests.models import build_layers, pytree_input

# -- the executor over a fake transport ----------------------------------------------------------


def _received(actions, stage, stages, skips=(), virtual_stages=1):
    """The messages ``actions`` on ``stage`` receive, per peer stage, as :func:`receives` names them."""
    return Counter(t.peer for a in actions for t in receives(a, stage, stages, skips, virtual_stages))


def _step(
    seq, balance, chunks, x, y, checkpoint="except_last", loss_fn=nn.functional.mse_loss, recorder=None
):
    """One training step of ``seq`` cut by ``balance`` into stages over a fake network.

    Returns the stages in stage order, the loss, and per stage the messages received per source
    rank in its forward phase and in its backward phase.
    """
    k, network = len(balance), FakeNetwork()
    stages = []
    for stage_index in range(k):
        rank = Layout(k, k).rank(0, stage_index)
        stage = build_stage(seq, balance, Layout(k, k), rank, chunks, checkpoint, torch.device("cpu"))
        stage.p2p, stage.timeline = FakeP2P(network, rank), (recorder or Recorder)()
        stages.append(stage)
    forward, backward = {}, {}
    out = None
    for stage in stages:
        result = stage.run_step(stage, True, x)
        assert (result is StageDone) == (not stage.topology.is_last)
        out = result if stage.topology.is_last else out
        forward[stage.topology.stage] = stage.p2p.phase()
    loss = loss_fn(out, y)
    for stage in reversed(stages):  # the last stage sends the loss message before the others take it
        assert stage.share_outcome(loss if stage.topology.is_last else None, None, training=True) is not None
        if not stage.topology.is_last:
            assert stage.p2p.phase() == Counter({stage.topology.ranks[-1]: 1})  # the outcome only
    loss.backward()
    for stage in reversed(stages):
        stage.backward()
        backward[stage.topology.stage] = stage.p2p.phase()
    return stages, loss, forward, backward


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_executor_runs_exactly_the_fill_drain_column_and_receives_its_messages(k, m):
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    stages, _, forward, backward = _step(seq, uniform_balance(3, k), m, x, y)
    grid = fill_drain(k, m)
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        assert stage.timeline.actions == [str(a) for a in stage_actions(grid, j)], (
            f"stage {j}\n{format_grid(grid)}"
        )
        previous = Counter({top.prev_rank: m}) if top.prev_rank is not None else Counter()
        following = Counter({top.next_rank: m}) if top.next_rank is not None else Counter()
        assert forward[j] == previous
        assert backward[j] == following


def _by_rank(topology, counts):
    return Counter({topology.ranks[stage]: n for stage, n in counts.items()})


def test_executor_matches_the_unpartitioned_model_with_skips_across_stages():
    torch.manual_seed(0)
    seq = nn.Sequential(
        Stash("a", nn.Linear(4, 6)),
        nn.Tanh(),
        nn.Linear(6, 6),
        Stash("b", nn.Tanh()),
        Pop("a"),
        nn.Linear(6, 6),
        Pop("b"),
        nn.Linear(6, 2),
    )
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    plain = [p.detach().clone() for p in seq.parameters()]
    reference = nn.functional.mse_loss(seq(x), y)
    reference.backward()
    expected = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    with torch.no_grad():
        for p, v in zip(seq.parameters(), plain):
            p.copy_(v)
    stages, loss, forward, backward = _step(seq, [2, 3, 3], 3, x, y, checkpoint="always")
    assert torch.allclose(loss, reference)
    for p, g in zip(seq.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)
    skips = stages[0].topology.skips
    assert {(r.name, r.source, r.target) for r in skips} == {("a", 0, 1), ("b", 1, 2)}
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        column = stage_actions(fill_drain(3, 3), j)
        assert stage.timeline.actions == [str(a) for a in column]
        f, b = column[:3], column[3:]
        assert forward[j] == _by_rank(top, _received(f, j, 3, skips))
        assert backward[j] == _by_rank(top, _received(b, j, 3, skips))  # every skip's gradient flows here
    assert stages[2].received_skips == [("b", 1)] * 3 and stages[1].received_skips == [("a", 0)] * 3


def _micro_step(
    seq, balance, chunks, x, y, schedule, checkpoint="except_last", recorder=Recorder, seen=None, posted=None
):
    """One training step of ``seq`` with one call per micro-batch, each stage in its own thread.

    Each stage runs :func:`~tests.fakes.micro_step` (the last one's loss each micro-batch's mean
    squared error), as the strategy drives it; with ``seen``, a dict, it records there, per stage,
    the spans ``recorder`` had seen when the outcome was shared (with ``posted``, a dict: the
    receives posted and not taken then, per source rank, and after). Returns the stages and, per
    stage, the messages received per source rank over the step.
    """
    k, network = len(balance), BlockingNetwork()
    stages = []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(
            seq, balance, Layout(k, k), rank, chunks, checkpoint, torch.device("cpu"), schedule=schedule
        )
        stage.p2p, stage.timeline = ThreadP2P(network, rank), recorder(stage)
        stages.append(stage)
    counts = {}

    @contextmanager
    def watched(stage):
        before = +stage.p2p.posted
        yield
        if posted is not None:
            posted[stage.topology.stage] = (before, +stage.p2p.posted)
        if seen is not None:
            seen[stage.topology.stage] = list(stage.timeline.actions)

    def body(stage):
        micro_step(stage, (x, y), lambda b: nn.functional.mse_loss(stage(b[0]), b[1]), around_outcome=watched)
        counts[stage.topology.stage] = stage.p2p.phase()

    in_threads(stages, body)
    return stages, counts


def _outcome(topology):
    """The step outcome's one message from the last stage, on a stage before it."""
    return Counter() if topology.is_last else Counter({topology.ranks[-1]: 1})


class _Spans(Recorder):
    """A :class:`Recorder` that also keeps the weight passes: ``F3``, ``B3`` (an input gradient or a
    whole backward), ``W3``."""

    @contextmanager
    def span(self, kind, i, u=0):
        if kind in ("forward", "backward", "weights"):
            self.actions.append(f"{kind[0].upper()}{i}")
        yield


@pytest.mark.parametrize("k", [2, 3])
def test_the_last_stage_shares_the_outcome_before_its_trailing_weight_passes(k):
    """zb_h1, M = 4: the last stage's weight passes after its last message wait for Lightning's
    backward, so the step outcome it sends leaves before them (the stages before it wait for the
    outcome, not for them); every other stage has run its whole column when it shares the outcome;
    the gradients equal one device's."""
    seq, m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), 4
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    expected, seen = _reference_grads(seq, x, y), {}
    stages, _ = _micro_step(seq, uniform_balance(3, k), m, x, y, zb_h1, "never", recorder=_Spans, seen=seen)
    for stage in stages:
        j, done = stage.topology.stage, stage.timeline.actions
        if j < k - 1:
            assert seen[j] == done, j
            continue
        column = [str(a) for a in stage_actions(zb_h1(k, m), j)]
        trailing = column[1 + max(n for n, a in enumerate(column) if not a.startswith("W")) :]
        assert trailing and done == column
        assert seen[j] + trailing == done
    for p, g in zip(seq.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("schedule", [zb_h1, one_f_one_b])
@pytest.mark.parametrize("k", [2, 3])
def test_the_stages_before_the_last_post_the_outcome_before_they_share_it(schedule, k):
    """One call per micro-batch, M = 4: when a stage before the last comes to share the step
    outcome, the outcome's receive from the last stage is the one receive it has posted (on Gloo
    its bytes then leave as the last stage sends them, not after a round trip); sharing takes it;
    the gradients equal one device's."""
    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    expected, posted = _reference_grads(seq, x, y), {}
    stages, _ = _micro_step(seq, uniform_balance(3, k), 4, x, y, schedule, "never", posted=posted)
    last = stages[-1].topology.ranks[-1]
    for stage in stages[:-1]:
        assert posted[stage.topology.stage] == (Counter({last: 1}), Counter()), stage.topology.stage
    assert posted[k - 1] == (Counter(), Counter())
    for p, g in zip(seq.parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def _reference_grads(seq, x, y):
    seq.zero_grad()
    nn.functional.mse_loss(seq(x), y).backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    return grads


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_executor_runs_exactly_the_1f1b_column_with_one_call_per_micro_batch(k, m):
    """Batch 10 (not divisible by 3, 4 or 8): the recorded actions are one_f_one_b's columns, every
    message received is one the column names or the step outcome, and the gradients equal the
    unpartitioned model's."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    expected = _reference_grads(seq, x, y)
    checkpoint = ["always", "except_last", "never"][m % 3]
    stages, counts = _micro_step(seq, uniform_balance(3, k), m, x, y, one_f_one_b, checkpoint)
    grid = one_f_one_b(k, min(m, 10))
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        column = stage_actions(grid, j)
        assert stage.timeline.actions == [str(a) for a in column], f"stage {j}\n{format_grid(grid)}"
        assert counts[j] == _by_rank(top, _received(column, j, k, top.skips)) + _outcome(top)
        assert stage.timeline.peak_held == min(k - j, m), f"stage {j} held too many micro-batches"
    for p, g in zip(seq.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)


@pytest.mark.parametrize("k", [2, 3])
def test_the_step_outcome_is_the_one_message_taken_between_the_phases_one_call_per_step(k):
    """Fill-drain, one call per step: a non-last stage's forward phase takes only the previous stage's
    activations; sharing the outcome takes exactly one message, from the last stage; its backward
    phase takes only the next stage's gradients."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    network, stages = FakeNetwork(), []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(seq, uniform_balance(3, k), Layout(k, k), rank, 4, "never", torch.device("cpu"))
        stage.p2p, stage.timeline = FakeP2P(network, rank), Recorder()
        stages.append(stage)
    out = [stage.run_step(stage, True, x) for stage in stages][-1]
    for stage in stages:
        top = stage.topology
        assert stage.p2p.phase() == (Counter({top.prev_rank: 4}) if top.prev_rank is not None else Counter())
    last = stages[-1].topology.ranks[-1]
    loss = nn.functional.mse_loss(out, y)
    for stage in reversed(stages):
        assert stage.share_outcome(loss if stage.topology.is_last else None, None, training=True) is not None
    for stage in stages:
        assert stage.p2p.phase() == (Counter() if stage.topology.is_last else Counter({last: 1}))
    loss.backward()
    for stage in reversed(stages):
        stage.backward()
        top = stage.topology
        assert stage.p2p.phase() == (Counter({top.next_rank: 4}) if top.next_rank is not None else Counter())


@pytest.mark.parametrize("schedule", [one_f_one_b, fill_drain])
@pytest.mark.parametrize("k", [2, 3])
def test_the_step_outcome_is_received_after_the_column_one_call_per_micro_batch(schedule, k):
    """One call per micro-batch: the outcome follows the whole column (the last call's backwards):
    a non-last stage receives its column's messages and one more, from the last stage."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    stages, counts = _micro_step(seq, uniform_balance(3, k), 4, x, y, schedule, "never")
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        expected = _by_rank(top, _received(stage_actions(schedule(k, 4), j), j, k, top.skips))
        assert counts[j] == expected + _outcome(top)


@pytest.mark.parametrize(
    ("schedule", "checkpoint"), [(fill_drain, "always"), (one_f_one_b, "always"), (zb_h1, "never")]
)
def test_one_call_per_micro_batch_with_skips_across_stages(schedule, checkpoint):
    """Skip connections across stages: any valid schedule runs with one call per micro-batch, ZB-H1's
    split backwards (nothing recomputed) too: a B sends the gradients of its input and of the skip it
    popped, its W computes the weights' (the weights' order:
    test_every_rank_of_a_run_executes_exactly_its_column)."""
    torch.manual_seed(0)
    seq = nn.Sequential(
        Stash("a", nn.Linear(4, 6)),
        nn.Tanh(),
        nn.Linear(6, 6),
        Stash("b", nn.Tanh()),
        Pop("a"),
        nn.Linear(6, 6),
        Pop("b"),
        nn.Linear(6, 2),
    )
    x, y = torch.randn(7, 4), torch.randn(7, 2)
    expected = _reference_grads(seq, x, y)
    stages, counts = _micro_step(seq, [2, 3, 3], 4, x, y, schedule, checkpoint=checkpoint)
    for p, g in zip(seq.parameters(), expected):
        assert torch.allclose(p.grad, g, atol=1e-6)
    skips = stages[0].topology.skips
    for stage in stages:
        top, j = stage.topology, stage.topology.stage
        column = stage_actions(schedule(3, 4), j)
        assert stage.timeline.actions == recorded(column, j)
        assert counts[j] == _by_rank(top, _received(column, j, 3, skips)) + _outcome(top)
    assert stages[2].received_skips == [("b", 1)] * 4 and stages[1].received_skips == [("a", 0)] * 4


def test_one_call_per_step_refuses_a_schedule_that_needs_a_loss_before_the_last_forward():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    stage = build_stage(seq, [2], Layout(1, 1), 0, 2, "never", torch.device("cpu"), schedule=one_f_one_b)
    with pytest.raises(PipelineUsageError, match="needs the user's training_step once per micro-batch"):
        stage.run_step(stage, True, torch.zeros(4, 4))


def test_a_micro_step_that_never_calls_the_sequential_names_where_the_column_stopped():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    stage = build_stage(seq, [2], Layout(1, 1), 0, 3, "never", torch.device("cpu"), schedule=one_f_one_b)
    stage.start_micro_steps(3)
    out = stage.run_step(stage, True, torch.zeros(2, 4))
    out.sum().backward()
    stage.loss_backpropagated(0)
    with pytest.raises(
        PipelineUsageError, match=r"stage 0 stopped at F1 of its column with 1 of 3 micro-batches"
    ):
        stage.end_micro_steps()


def _pytree_loss(out, y):
    """Uses the per-sample output, the replicated tables handed back, and checks the constants."""
    assert out["scale"] == 0.5 and out["note"] is None
    return nn.functional.mse_loss(out["y"], y) + 0.1 * (out["rope"][0] * out["rope"][1]).sum()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_executor_passes_a_pytree_and_matches_the_unpartitioned_model(checkpoint):
    """A dict of split, replicated and non-tensor leaves across 3 stages, batch 10, chunks 4: the
    loss, every parameter's gradient, the split input's and the replicated input table's
    (the sum over micro-batches) equal one device."""
    torch.manual_seed(0)
    seq = build_layers("pytree")
    x, mask, y = torch.randn(10, 7, 8), torch.rand(10, 7) > 0.3, torch.randn(10, 7, 3)

    def inputs():
        value = pytree_input(x.clone().requires_grad_(), mask)
        value["rope"] = (value["rope"][0].requires_grad_(), value["rope"][1])  # a replicated leaf with grad
        return value

    ref_in = inputs()
    reference = _pytree_loss(seq(ref_in), y)
    reference.backward()
    expected = {n: p.grad.clone() for n, p in seq.named_parameters()}
    seq.zero_grad()
    pipe_in = inputs()
    stages, loss, _, _ = _step(seq, [2, 2, 2], 4, pipe_in, y, checkpoint, loss_fn=_pytree_loss)
    assert abs(loss.item() - reference.item()) <= 1e-6
    worst = max((p.grad - expected[n]).abs().max().item() for n, p in seq.named_parameters())
    assert worst <= 1e-5 and seq[0].gain.grad.abs().sum() > 0
    assert torch.allclose(pipe_in["h"].grad, ref_in["h"].grad, atol=1e-5)
    assert torch.allclose(pipe_in["rope"][0].grad, ref_in["rope"][0].grad, atol=1e-5)


def test_an_error_in_a_stages_layers_names_the_stage_the_micro_batch_and_the_shapes():
    seq = nn.Sequential(nn.Linear(16, 4), nn.Tanh())
    stage = build_stage(seq, [2], Layout(1, 1), 0, 2, "never", torch.device("cpu"))
    with pytest.raises(StageError) as info:
        stage.run_step(stage, True, torch.zeros(4, 17))
    message = str(info.value)
    assert "stage 0 (layers 0..1) failed in forward of micro-batch 0 on input from the batch" in message
    assert "of shape [(2, 17) float32]; its first layer (Linear) expects (*, 16)" in message
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("k", [1, 2])
def test_before_backward_marks_each_stages_last_backward_of_the_step(k):
    """Sharded data parallel (lightning_gpipe.strategy.sharding) reduces gradients on a stage's last backward
    of the step only: the executor calls ``before_backward(virtual stage, last)`` before every B, ``last`` on
    the column's final B (micro-batch 0 under fill-drain); with ``split_backward=False`` the gradients
    still equal the unpartitioned model's."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    network, stages, calls = FakeNetwork(), [], {}
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(
            seq, uniform_balance(3, k), Layout(k, k), rank, 4, "except_last", torch.device("cpu")
        )
        stage.p2p = FakeP2P(network, rank)
        stage.executor.split_backward = False
        calls[j] = []
        stage.executor.before_backward = lambda u, last, j=j: calls[j].append((u, last))
        stages.append(stage)
    out = None
    for stage in stages:
        result = stage.run_step(stage, True, x)
        out = result if stage.topology.is_last else out
    loss = nn.functional.mse_loss(out, y)
    for stage in reversed(stages):
        stage.share_outcome(loss if stage.topology.is_last else None, None, training=True)
    loss.backward()
    for stage in reversed(stages):
        stage.backward()
    assert all(calls[j] == [(0, False)] * 3 + [(0, True)] for j in range(k))
    seq.zero_grad()
    nn.functional.mse_loss(seq(x), y).backward()
    got = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
    assert max((got[n] - p.grad).abs().max().item() for n, p in seq.named_parameters()) <= 1e-6
