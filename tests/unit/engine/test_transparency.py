"""The pipelined model trains exactly like the unpartitioned model on one device, in one process.

K stages run over the in-process fakes (:mod:`tests.fakes`): with one call per step (``"gpipe"``,
fill-drain, the stages one after the other) or one call per micro-batch (every schedule, each stage
in its own thread). For K ∈ {1, 2, 3}, M ∈ {1, 3, 4, 8}, every checkpoint mode and every schedule,
three SGD-with-momentum steps on batch 10 (not divisible by 3, 4 or 8): each step's loss and every
gradient equal the same model's on one device (full batch), and so do the weights after the steps.
The Lightning glue around this (logging, the strategy's steps) is run in processes by
tests/distributed/test_transparency.py.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from lightning_gpipe.schedule import SCHEDULES, check_virtual_stages, interleaved_1f1b
from tests.fakes import _micro_step, _step, micro_step_virtual
from tests.models import build_layers, make_data, pytree_input

MODES = ["always", "except_last", "never"]
CHUNKS = [1, 3, 4, 8]
# "gpipe": the user's step once per mini-batch (fill-drain); "gpipe/micro": fill-drain with one
# call per micro-batch; the others run one call per micro-batch as the strategy has them do.
RUNS = ["gpipe", "gpipe/micro", "1f1b", "interleaved_1f1b", "zb_h1"]
VIRTUAL = 2  # virtual stages per stage under interleaved_1f1b


def _mlp() -> nn.Sequential:
    """Six layers, so that 3 stages × 2 virtual stages each hold one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3)
    )


def _batches(steps: int = 3, batch: int = 10, kind: str = "mlp"):
    return [tuple(b) for b in itertools.islice(make_data(kind, batch, max(steps, 5)), steps)]


def _pipelined_step(seq, run, k, m, checkpoint, x, y, loss_fn, balance=None):
    """One pipelined training step; the gradients land on ``seq``'s parameters. Returns the loss."""
    if run == "interleaved_1f1b":
        return micro_step_virtual(seq, k, VIRTUAL, m, x, y, checkpoint, loss_fn)[2]
    balance = balance or uniform_balance(len(seq), k)
    if run == "gpipe":
        return _step(seq, balance, m, x, y, checkpoint, loss_fn=loss_fn)[1].detach()
    schedule = SCHEDULES["gpipe" if run == "gpipe/micro" else run]
    return _micro_step(seq, balance, m, x, y, schedule, checkpoint, loss_fn=loss_fn)[2]


def train_like_one_device(
    build, batches, k, m, checkpoint, run, loss_fn=F.mse_loss, balance=None, inputs=lambda x: x, exact=False
):
    """Train ``build()`` pipelined and a copy of it on one device, step by step; assert that every
    step's loss and gradients and the final weights are equal (within float32 tolerances, or
    bit for bit with ``exact``). Returns the pipelined model."""
    seq = build()
    ref = copy.deepcopy(seq)
    opt = torch.optim.SGD(seq.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    where = f"{run} K={k} M={m} checkpoint={checkpoint}"
    check = (lambda a, b, msg: torch.testing.assert_close(a, b, atol=0, rtol=0, msg=msg)) if exact else None
    check = check or (lambda a, b, msg: torch.testing.assert_close(a, b, msg=msg))
    for s, (*xs, y) in enumerate(batches):
        x = xs[0] if len(xs) == 1 else tuple(xs)
        loss = _pipelined_step(seq, run, k, m, checkpoint, inputs(x), y, loss_fn, balance)
        ref_loss = loss_fn(ref(inputs(x)), y)
        ref_loss.backward()
        check(loss, ref_loss.detach(), f"{where} step {s}: loss")
        for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
            check(p.grad, q.grad, f"{where} step {s}: gradient of {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ref_state = ref.state_dict()
    for name, value in seq.state_dict().items():
        check(value, ref_state[name], f"{where}: {name} after {len(batches)} steps")
    return seq


GRID = [
    (k, m, c, run)
    for k, m, c, run in itertools.product([1, 2, 3], CHUNKS, MODES, RUNS)
    if not (run == "interleaved_1f1b" and k == 1)
]


@pytest.mark.parametrize(("k", "m", "checkpoint", "run"), GRID)
def test_every_schedule_trains_like_one_device(k, m, checkpoint, run):
    """Batch 10, 3 SGD+momentum steps: losses, every gradient and the weights equal one device's."""
    train_like_one_device(_mlp, _batches(), k, m, checkpoint, run)


@pytest.mark.parametrize("m", CHUNKS)
def test_interleaving_refuses_one_stage(m):
    """Where the grid has no interleaved case (K = 1): the schedule refuses virtual stages on one stage."""
    with pytest.raises(ValueError, match="virtual stages need two or more pipeline stages"):
        interleaved_1f1b(1, m, VIRTUAL)
    with pytest.raises(ValueError, match="virtual stages need two or more pipeline stages"):
        check_virtual_stages("interleaved_1f1b", None, stages=1)


# -- stage boundaries other than one tensor ------------------------------------------------------


def _tuple_loss(out, y):
    return F.mse_loss(out, y)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuple_boundaries_with_long_ids_and_bool_mask(run, checkpoint):
    """Stages pass (float activations, long ids, bool mask); 3 stages (2 under interleaving: its
    4 layers make 4 parts), batch 10, chunks 4."""
    k = 2 if run == "interleaved_1f1b" else 3

    def build():
        torch.manual_seed(0)
        return build_layers("tuple")

    balance = None if run == "interleaved_1f1b" else [1, 2, 1]
    train_like_one_device(build, _batches(2, 10, "tuple"), k, 4, checkpoint, run, balance=balance)


def _pytree_loss(out, y):
    """tests.models.Net's loss: the per-sample output and the replicated tables handed back."""
    assert out["scale"] == 0.5 and out["note"] is None
    assert out["y"].shape == y.shape and out["y"].shape[1:] == (7, 3)
    return F.mse_loss(out["y"], y) + 0.1 * out["rope"][0].square().mean()


@pytest.mark.parametrize("checkpoint", MODES)
def test_pytree_boundaries_with_split_replicated_and_constant_leaves(checkpoint):
    """{"h", "mask", "causal", "rope": (cos, sin), "scale": 0.5, "note": None} across 3 stages, batch
    10, chunks 4, one call per step: the rotary tables are replicated and require grad (a learned
    gain on stage 0), the loss uses them; 2 steps equal one device's (losses, gradients, weights)."""

    def build():
        torch.manual_seed(0)
        return build_layers("pytree")

    train_like_one_device(
        build,
        _batches(2, 10, "pytree"),
        3,
        4,
        checkpoint,
        "gpipe",
        loss_fn=_pytree_loss,
        balance=[2, 2, 2],
        inputs=lambda x: pytree_input(*x),
    )


@pytest.mark.parametrize("run", RUNS)
def test_sequence_lengths_change_between_steps(run):
    """Batches with sequence lengths 7, 13, 5 through 3 stages (2 under interleaving), chunks 4:
    each step's loss, gradients and the weights equal one device's."""
    k = 2 if run == "interleaved_1f1b" else 3

    def build():
        torch.manual_seed(0)
        return build_layers("seq")

    batches = _batches(3, 6, "seq")
    assert [x.shape for x, _ in batches] == [(6, 7, 4), (6, 13, 4), (6, 5, 4)]
    shapes = []

    def loss_fn(out, y):
        shapes.append(tuple(out.shape))
        return F.mse_loss(out, y)

    train_like_one_device(build, batches, k, 4, "except_last", run, loss_fn=loss_fn)
    # the last stage's outputs (per call) and the one-device model's, step by step: (N, T, 2)
    assert {s[1:] for s in shapes} == {(7, 2), (13, 2), (5, 2)}
    assert {s for s in shapes if s[0] == 6} == {(6, 7, 2), (6, 13, 2), (6, 5, 2)}


# -- random layers and batch normalisation -------------------------------------------------------


def _dropout_run(run, checkpoint, k=2, m=3):
    torch.manual_seed(0)
    seq = build_layers("dropout")
    torch.manual_seed(1)
    opt = torch.optim.SGD(seq.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for x, y in _batches(2, 10, "dropout"):
        losses.append(_pipelined_step(seq, run, k, m, checkpoint, x, y, F.mse_loss))
        grads.append({n: p.grad.clone() for n, p in seq.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, seq.state_dict()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_dropout_recompute_is_bit_identical(k, m):
    """Same seed, checkpoint "always" vs "never": recompute replays the forward's dropout masks, so
    losses, gradients and weights are equal bit for bit; the masks are drawn (the loss differs from
    the model without dropout).

    One call per step only: stages in threads of one process share the process's generators (a
    stage's stream is swapped in around its forwards), so concurrent forwards would draw from each
    other's streams; the schedules with one call per micro-batch are checked in processes
    (tests/distributed/test_random_layers.py)."""
    always, never = _dropout_run("gpipe", "always", k, m), _dropout_run("gpipe", "never", k, m)
    assert [loss.item() for loss in always[0]] == [loss.item() for loss in never[0]]
    for g_always, g_never in zip(always[1], never[1]):
        assert g_always.keys() == g_never.keys()
        assert all(torch.equal(g_always[k], g_never[k]) for k in g_always)
    assert all(torch.equal(always[2][k], never[2][k]) for k in always[2])
    torch.manual_seed(0)
    plain = build_layers("dropout").eval()
    x, y = _batches(1, 10, "dropout")[0]
    assert always[0][0].item() != F.mse_loss(plain(x), y).item()


def _bn_run(run, checkpoint, steps=2, m=3):
    torch.manual_seed(0)
    seq = build_layers("bn")
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    for x, y in _batches(steps, 10, "bn"):
        _pipelined_step(seq, run, 2, m, checkpoint, x, y, F.mse_loss, balance=[3, 3])
        opt.step()
        opt.zero_grad()
    return seq.state_dict()


@pytest.mark.parametrize("run", ["gpipe", "1f1b", "zb_h1"])
def test_batchnorm_running_stats_updated_once_per_micro_batch(run):
    """Recompute must not update BatchNorm running statistics a second time: 2 steps × 3 micro-batches."""
    always, never = _bn_run(run, "always"), _bn_run(run, "never")
    for name in ("1", "4"):
        assert always[f"{name}.num_batches_tracked"].item() == 2 * 3  # steps × micro-batches
        assert torch.equal(always[f"{name}.running_mean"], never[f"{name}.running_mean"])
        assert torch.equal(always[f"{name}.running_var"], never[f"{name}.running_var"])


BN_KEYS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.mark.parametrize(
    ("run", "checkpoint"),
    [
        ("gpipe", "always"),
        ("gpipe", "never"),
        ("1f1b", "always"),
        ("zb_h1", "never"),
        ("gpipe/micro", "except_last"),
    ],
)
@pytest.mark.parametrize("m", [1, 4])
def test_deferred_batch_norm_running_stats_equal_full_batch(run, checkpoint, m):
    """Conv-BN-ReLU over 3 stages, batch 16: with deferred batch norm, committed once after the step's
    last micro-batch, the running statistics equal the one-device full-batch values; without it
    they are those of M micro-batch updates (num_batches_tracked counts micro-batches)."""
    x, y = _batches(1, 16, "cbr")[0]
    torch.manual_seed(0)
    reference = build_layers("cbr")
    pipelined, plain = copy.deepcopy(reference), copy.deepcopy(reference)
    F.mse_loss(reference(x), y).backward()
    expected = {k: reference[1].state_dict()[k] for k in BN_KEYS}
    convert_deferred_batch_norm(pipelined)
    _pipelined_step(pipelined, run, 3, m, checkpoint, x, y, F.mse_loss, balance=[1, 1, 1])
    commit_deferred_batch_norm(pipelined)
    deferred = pipelined[1].state_dict()
    for key in BN_KEYS:
        torch.testing.assert_close(deferred[key], expected[key], msg=key)
    assert deferred["num_batches_tracked"].item() == 1
    _pipelined_step(plain, run, 3, m, checkpoint, x, y, F.mse_loss, balance=[1, 1, 1])
    assert plain[1].num_batches_tracked.item() == m
    if m > 1:
        assert (plain[1].running_mean - expected["running_mean"]).abs().max() > 1e-3
