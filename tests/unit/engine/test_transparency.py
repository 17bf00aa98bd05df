"""The pipeline computes what the plain module computes on one device, checked in one process.

K stages built with :func:`~lightning_gpipe.partition.build.build_stage` (one per rank of
``Layout(K, K)``) run in threads over an in-process transport (:mod:`tests.fakes`), driven as the
strategy drives them: one call per step under ``"gpipe"`` (``run_step``, ``share_outcome``,
``backward``), one call per micro-batch under the other schedules (``start_micro_steps``, each call,
the last stage backpropagating ``(n_i / N) · loss_i`` and calling ``loss_backpropagated``,
``end_micro_steps``, ``share_outcome``, ``backward``, as :mod:`lightning_gpipe.strategy.microstep`
does: :func:`tests.fakes.micro_step`). Each step's loss (on every
stage: the last stage's outcome) and every parameter's gradient equal those of a deep copy of the
model run on the whole batch on one device; two SGD steps apply the same update to both. The
Lightning glue around this (the strategy, logging, checkpoints, the processes) stays in
tests/test_transparency.py and tests/test_virtual_transparency.py.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from lightning_gpipe.engine.microbatch import sizes
from lightning_gpipe.engine.stage import StageDone
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import SCHEDULES, check_virtual_stages, stage_actions
from lightning_gpipe.transport.layout import Layout
from tests.fakes import Recorder, TurnNetwork, TurnP2P, in_threads, micro_step, recorded
from tests.models import build_layers, pytree_input

TIGHT = {"atol": 1e-6, "rtol": 1e-5}
CPU = torch.device("cpu")


def _mlp() -> nn.Sequential:
    """Six layers: cut into up to K·v = 6 parts (interleaved 1F1B, K = 3, v = 2)."""
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3)
    )


def _stages(seq, k, chunks, checkpoint, schedule, v=1, balance=None):
    """The K stages of ``seq`` (cut into K·v parts), one per rank of ``Layout(K, K)``, over one
    :class:`~tests.fakes.TurnNetwork`: the stages' threads take turns, so each stage's layers draw from
    its own stream and the process's generators end as they were."""
    balance = balance or uniform_balance(len(seq), k * v)
    network = TurnNetwork()
    stages = []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(seq, balance, Layout(k, k), rank, chunks, checkpoint, CPU, SCHEDULES[schedule])
        stage.p2p, stage.timeline = TurnP2P(network, rank), Recorder(stage)
        stages.append(stage)
    return stages


def _train_step(stages, batch, y, loss_fn, schedule, chunks):
    """One training step of ``stages`` (each in a thread) on ``(batch, y)``, as the strategy drives it.

    Returns the step's loss as each stage ends it with (the last stage's own; the others' from the
    outcome), per stage.
    """
    losses = {}

    def body(stage):
        top = stage.topology
        if schedule == "gpipe":
            out = stage.run_step(stage, True, batch)
            assert (out is StageDone) == (not top.is_last)
            loss = loss_fn(out, y) if top.is_last else None
            shared = stage.share_outcome(loss, None, training=True)
            if top.is_last:
                loss.backward()
            stage.backward()
        else:
            shared = micro_step(stage, (batch, y), lambda b: loss_fn(stage(b[0]), b[1]), chunks)
        losses[top.stage] = shared.detach()

    in_threads(stages, body, turn=stages[0].p2p.network.turn)
    return [losses[j] for j in range(len(stages))]


def _reference_step(ref, batch, y, loss_fn):
    """The plain model's loss on the whole batch; its gradients are left in ``ref``."""
    ref.zero_grad()
    loss = loss_fn(ref(batch), y)
    loss.backward()
    return loss.detach()


def _assert_same_gradients(seq, ref):
    ours, theirs = dict(seq.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        if p.grad is None:
            assert ours[name].grad is None, name
        else:
            torch.testing.assert_close(ours[name].grad, p.grad, **TIGHT, msg=name)


def _sgd(*models):
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None


def _check_steps(seq, stages, batches, loss_fn, schedule, chunks):
    """Each of ``batches`` one step on the pipeline and on a deep copy of ``seq`` on one device (taken
    now): the loss on every stage and every gradient equal the copy's; then an SGD step on both."""
    ref = copy.deepcopy(seq)
    for batch, y in batches:
        expected = _reference_step(ref, batch, y, loss_fn)
        seq.zero_grad()
        losses = _train_step(stages, batch, y, loss_fn, schedule, chunks)
        for loss in losses:
            torch.testing.assert_close(loss.to(expected.dtype), expected, **TIGHT)
        _assert_same_gradients(seq, ref)
        _sgd(seq, ref)
    for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TIGHT, msg=name)


# -- the grid: K × M × checkpoint × schedule ------------------------------------------------------

GRID = list(
    itertools.product(
        [1, 2, 3],
        [1, 3, 4, 8],
        ["always", "except_last", "never"],
        ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"],
    )
)


@pytest.mark.parametrize(("k", "m", "checkpoint", "schedule"), GRID)
def test_grid_matches_one_device(k, m, checkpoint, schedule):
    """Batch 10 (not divisible by 3, 4 or 8), two steps: the recorded actions are the schedule's
    columns, every stage's loss and every gradient equal one device's, and so do the parameters
    after two SGD steps; the process's generator ends as it was. Interleaved 1F1B runs 2 virtual
    stages and refuses one stage."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    if schedule == "interleaved_1f1b" and k == 1:
        with pytest.raises(ValueError, match="virtual stages need two or more pipeline stages"):
            SCHEDULES[schedule](k, m, v)
        with pytest.raises(ValueError, match="virtual stages need two or more pipeline stages"):
            check_virtual_stages(schedule, v, stages=k)  # GPipeStrategy's check, before any process starts
        return
    torch.manual_seed(0)
    seq = _mlp()
    batches = [(torch.randn(10, 6), torch.randn(10, 3)) for _ in range(2)]
    stages = _stages(seq, k, m, checkpoint, schedule, v)
    before = torch.get_rng_state()
    _check_steps(seq, stages, batches, F.mse_loss, schedule, m)
    assert torch.equal(torch.get_rng_state(), before), "the stages' streams left the process's generator"
    grid = SCHEDULES[schedule](k, min(m, 10), v)
    for stage in stages:
        j = stage.topology.stage
        assert stage.timeline.actions == recorded(stage_actions(grid, j), j) * 2, f"stage {j}"


def test_more_micro_batches_than_samples_runs_one_per_sample():
    """N = 3, M = 4: three micro-batches of one sample, under every schedule (interleaved on K = 2)."""
    for k, schedule in [(3, "gpipe"), (3, "1f1b"), (2, "interleaved_1f1b"), (3, "zb_h1")]:
        v = 2 if schedule == "interleaved_1f1b" else 1
        torch.manual_seed(1)
        seq = _mlp()
        stages = _stages(seq, k, 4, "except_last", schedule, v)
        _check_steps(seq, stages, [(torch.randn(3, 6), torch.randn(3, 3))], F.mse_loss, schedule, 4)
        grid = SCHEDULES[schedule](k, 3, v)
        for stage in stages:
            j = stage.topology.stage
            assert stage.timeline.actions == recorded(stage_actions(grid, j), j)


# -- what crosses a boundary -----------------------------------------------------------------------

CASES = [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "zb_h1")]


def _tuple_batch(g):
    x = torch.randn(10, 7, 4, generator=g)
    ids = torch.randint(0, 5, (10, 7), generator=g)
    mask = torch.rand(10, 7, generator=g) > 0.3
    return (x, ids, mask), torch.randn(10, 7, 3, generator=g)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(("k", "schedule"), CASES)
def test_tuple_boundaries_with_long_ids_and_bool_mask(k, schedule, checkpoint):
    """Stages pass (float activations, long ids, bool mask); batch 10, chunks 4, two steps."""
    torch.manual_seed(0)
    seq = build_layers("tuple")
    g = torch.Generator().manual_seed(1)
    batches = [_tuple_batch(g) for _ in range(2)]
    embedding = seq[2].emb.weight.detach().clone()  # on the last stage: reached through the long ids
    stages = _stages(seq, k, 4, checkpoint, schedule)
    _check_steps(seq, stages, batches, F.mse_loss, schedule, 4)
    assert not torch.equal(seq[2].emb.weight, embedding)


class _ToComplex(nn.Module):
    """(N, 2d) real to (N, d) complex."""

    def forward(self, h):
        return torch.complex(h[:, ::2], h[:, 1::2])


class _FromComplex(nn.Module):
    def forward(self, z):
        return (z * z.conj()).real + z.real


@pytest.mark.parametrize(("k", "schedule"), [*CASES, (2, "interleaved_1f1b")])
def test_complex_activations_between_stages(k, schedule):
    """A complex activation crosses a boundary (and carries its gradient back): every gradient
    equals one device's."""
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(6, 16), _ToComplex(), _FromComplex(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    balance = {2: [2, 4], 3: [2, 2, 2]}[k] if schedule != "interleaved_1f1b" else [2, 1, 2, 1]
    v = 2 if schedule == "interleaved_1f1b" else 1
    stages = _stages(seq, k, 4, "never", schedule, v, balance)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)) for _ in range(2)]
    _check_steps(seq, stages, batches, F.mse_loss, schedule, 4)


def _pytree_loss(out, y):
    """Uses the per-sample output and the replicated tables handed back; checks the constants."""
    assert out["scale"] == 0.5 and out["note"] is None and out["y"].shape == y.shape
    return F.mse_loss(out["y"], y) + 0.1 * out["rope"][0].square().mean()


@pytest.mark.parametrize(("k", "schedule"), CASES)
def test_pytree_boundaries_with_split_replicated_and_constant_leaves(k, schedule):
    """Stages pass {"h": (N, T, d), "mask": bool (N, T), "causal": bool (T, T), "rope": (cos, sin),
    "scale": 0.5, "note": None}; the rotary tables are replicated and require grad (a learned gain on
    stage 0) and reach the loss: every gradient equals one device's, the gain's too (the sum over
    micro-batches), and it is not zero."""
    torch.manual_seed(0)
    seq = build_layers("pytree")
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        x, mask = torch.randn(10, 7, 8, generator=g), torch.rand(10, 7, generator=g) > 0.3
        batches.append((pytree_input(x, mask), torch.randn(10, 7, 3, generator=g)))
    gain = seq[0].gain.detach().clone()
    stages = _stages(seq, k, 4, "except_last", schedule)
    _check_steps(seq, stages, batches, _pytree_loss, schedule, 4)
    assert not torch.equal(seq[0].gain, gain)  # the replicated tables' gradient reached the gain


@pytest.mark.parametrize(
    ("k", "schedule"), [(3, "gpipe"), (3, "1f1b"), (2, "interleaved_1f1b"), (2, "zb_h1")]
)
def test_sequence_lengths_change_between_steps(k, schedule):
    """Batches of 6 with sequence lengths 7, 13, 5 through the same stages, chunks 4: shapes right,
    each step's loss and gradients equal one device's."""
    torch.manual_seed(0)
    seq = nn.Sequential(*build_layers("seq"), nn.Identity())  # six layers: K·v parts up to 4
    v = 2 if schedule == "interleaved_1f1b" else 1
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, t, 4, generator=g), torch.randn(6, t, 2, generator=g)) for t in (7, 13, 5)]
    shapes = []

    def loss_fn(out, y):
        shapes.append(tuple(out.shape))
        return F.mse_loss(out, y)

    stages = _stages(seq, k, 4, "except_last", schedule, v)
    _check_steps(seq, stages, batches, loss_fn, schedule, 4)
    if schedule == "gpipe":
        assert shapes[1::2] == [(6, 7, 2), (6, 13, 2), (6, 5, 2)]  # the reference's calls, then ours
    else:
        parts = sizes(6, 4)
        ours = [s for n, s in enumerate(shapes) if n % (len(parts) + 1)]
        assert ours == [(p, t, 2) for t in (7, 13, 5) for p in parts]


# -- random layers: each stage draws from its own stream --------------------------------------------

DROPOUT_BALANCE = [3, 3]  # [Linear, Dropout(0.5), Tanh] | [Linear, Dropout(0.3), Linear]


def _per_stage_streams(seq, balance, batches, chunks, steps_state):
    """One device, no pipeline: stage k's layers run on each micro-batch in order from stage k's
    stream (``torch.Generator().manual_seed(base + k)``, ``base`` drawn and put back from the global
    generator as it stands now), each stream kept from step to step (in ``steps_state``), an SGD step
    after each. Returns the losses."""
    if not steps_state:
        with torch.random.fork_rng():
            base = int(torch.randint(2**62, (1,)))
        steps_state.extend(torch.Generator().manual_seed(base + k).get_state() for k in range(len(balance)))
    losses = []
    for x, y in batches:
        seq.zero_grad()
        parts = sizes(len(x), chunks)
        hs, ys = list(x.split(parts)), y.split(parts)
        start = 0
        with torch.random.fork_rng():
            for k, count in enumerate(balance):
                layers = seq[start : start + count]
                start += count
                torch.set_rng_state(steps_state[k])
                hs = [layers(h) for h in hs]
                steps_state[k] = torch.get_rng_state()
        loss = sum(len(h) / len(x) * F.mse_loss(h, yi) for h, yi in zip(hs, ys))
        loss.backward()
        losses.append(loss.detach())
        _sgd(seq)
    return losses


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize(("chunks", "schedule"), [(2, "gpipe"), (3, "gpipe"), (3, "1f1b"), (4, "zb_h1")])
def test_dropout_masks_equal_one_device_running_each_stage_on_the_micro_batches(chunks, schedule, checkpoint):
    """Dropout on both of 2 stages, 3 steps of batch 10: the losses and weights equal one device keeping
    one generator per stage (seeded from the global generator at the first step) and drawing each
    stage's masks micro-batch by micro-batch; recompute replays the masks bit for bit (every checkpoint
    mode gives the same weights exactly); one generator over the whole batch gives other weights."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    seq = build_layers("dropout")
    ref, plain = copy.deepcopy(seq), copy.deepcopy(seq)
    torch.manual_seed(5)  # the global generator the stages (and the emulation) draw their base from
    expected = _per_stage_streams(ref, DROPOUT_BALANCE, batches, chunks, [])
    never = copy.deepcopy(seq)
    for mode, model in ((checkpoint, seq), ("never", never)):
        torch.manual_seed(5)
        stages = _stages(model, 2, chunks, mode, schedule, balance=DROPOUT_BALANCE)
        losses = []
        for x, y in batches:
            model.zero_grad()
            losses.append(_train_step(stages, x, y, F.mse_loss, schedule, chunks)[-1])
            _sgd(model)
        if model is seq:
            torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TIGHT)
            recomputed = losses
    assert torch.equal(torch.stack(recomputed), torch.stack(losses)), "recompute changed a loss"
    for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TIGHT, msg=name)
        assert torch.equal(p, dict(never.named_parameters())[name]), f"{name}: recompute changed the masks"
    torch.manual_seed(5)
    _per_stage_streams(plain, [6], batches, 1, [])  # one generator, whole batch, whole model
    assert max((p - q).abs().max().item() for p, q in zip(seq.parameters(), plain.parameters())) > 1e-3


# -- BatchNorm ---------------------------------------------------------------------------------------


def _micro_batch_reference(ref, batches, chunks):
    """One device running each micro-batch through the whole model in turn (each BatchNorm normalises
    it on its own and updates its running statistics once per micro-batch), the loss weighted by size."""
    losses = []
    for x, y in batches:
        ref.zero_grad()
        parts = sizes(len(x), chunks)
        loss = sum(
            n / len(x) * F.mse_loss(ref(xi), yi) for n, xi, yi in zip(parts, x.split(parts), y.split(parts))
        )
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(("k", "schedule"), [(2, "gpipe"), (2, "1f1b"), (3, "zb_h1")])
def test_batchnorm_running_stats_updated_once_per_micro_batch(k, schedule, checkpoint):
    """Two BatchNorms, batch 10, chunks 3, one step: the loss, the gradients and the running statistics
    equal one device running the micro-batches one after another; recompute does not update them a
    second time (num_batches_tracked = 3)."""
    torch.manual_seed(0)
    seq = build_layers("bn")
    ref = copy.deepcopy(seq)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    (expected,) = _micro_batch_reference(ref, [(x, y)], 3)
    stages = _stages(seq, k, 3, checkpoint, schedule)
    losses = _train_step(stages, x, y, F.mse_loss, schedule, 3)
    for loss in losses:
        torch.testing.assert_close(loss.to(expected.dtype), expected, **TIGHT)
    _assert_same_gradients(seq, ref)
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(dict(seq.named_buffers())[name], buffer, **TIGHT, msg=name)
    assert seq[1].num_batches_tracked.item() == seq[4].num_batches_tracked.item() == 3


@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("gpipe", "always"), ("1f1b", "always"), ("zb_h1", "never"), ("gpipe", "never")],
)
def test_deferred_batch_norm_running_stats_equal_full_batch(schedule, checkpoint):
    """Conv-BN-ReLU over 3 stages, batch 16, chunks 4, BatchNorm deferred: after the step (the
    statistics committed once, as the strategy does after the step's calls) the running statistics
    equal one device's full-batch values; without deferring they are those of 4 micro-batch updates."""
    torch.manual_seed(0)
    seq = build_layers("cbr")
    full, plain = copy.deepcopy(seq), copy.deepcopy(seq)
    x, y = torch.randn(16, 3, 5, 5), torch.randn(16, 4, 5, 5)
    F.mse_loss(full(x), y).backward()
    for model, deferred in ((convert_deferred_batch_norm(seq), True), (plain, False)):
        stages = _stages(model, 3, 4, checkpoint, schedule, balance=[1, 1, 1])
        _train_step(stages, x, y, F.mse_loss, schedule, 4)
        for stage in stages:
            commit_deferred_batch_norm(stage)
        bn, expected = model[1], full[1]
        if deferred:
            torch.testing.assert_close(bn.running_mean, expected.running_mean, **TIGHT)
            torch.testing.assert_close(bn.running_var, expected.running_var, **TIGHT)
            assert bn.num_batches_tracked.item() == 1
        else:
            assert bn.num_batches_tracked.item() == 4
            assert (bn.running_mean - expected.running_mean).abs().max() > 1e-3
