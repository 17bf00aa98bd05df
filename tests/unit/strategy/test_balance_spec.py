"""``balance=`` resolved for a model pipelined by ``plan=``: every balancer, with the head tied to the
embedding, cuts the chain and the cut trains like one device (issue 39 item 4)."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch

from lightning_gpipe.balance import balance_by_parameters
from lightning_gpipe.partition import plan
from lightning_gpipe.strategy import balance_spec
from tests.gpt import GPT, PLAN, gpt_data
from tests.unit.partition.test_plan import TIGHT, _loss, _stages, _step

CPU = torch.device("cpu")


def _choose(model, chain, how, uniform):
    return balance_spec.choose_balance(
        how, model, chain, uniform, stages=2, chunks=4, device=CPU, rank=0,
        broadcast=lambda obj: obj, to_device=lambda batch: batch, optimizer_state_factor=2.0,
    )  # fmt: skip


def test_every_balancer_cuts_a_plan_model_and_the_cut_trains_like_one_device(monkeypatch):
    """The nanoGPT-style model (head tied to the token embedding) by ``plan=PLAN``, without
    ``example_input_array``: ``"time"`` and ``"memory"`` profile the first training batch's first
    micro-batch, captured at the call of the plan's root (the chain itself is never called; the step
    stops there); ``"parameters"`` counts the embedding's and the head's parameters; a list is taken as
    given. Every balance puts the embedding and the head on different stages, and one step of the stages
    cut by the profiled time gives the one-device loss and gradients (the tied weight's summed over its
    two layers)."""
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    _, chain, uniform = plan.check_model(model, plan.check_plan(PLAN), None, None, 2, 1)
    model.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    monkeypatch.setattr(balance_spec, "running_loop_data", lambda trainer: ("training_step", gpt_data()))
    (ids,) = next(iter(gpt_data()))
    sample = balance_spec.sample_micro_batch(model, chain, "time", 4, CPU, lambda batch: batch)
    assert torch.equal(sample, ids[:2]) and model.losses == []
    chosen = {how: _choose(model, chain, how, uniform) for how in ("time", "memory", "parameters")}
    assert chosen["parameters"] == balance_by_parameters(chain, 2) == [3, 4]
    assert _choose(model, chain, [2, 5], [2, 5]) == [2, 5]
    for how, balance in chosen.items():
        assert sum(balance) == 7 and len(balance) == 2 and balance[0] < 6, (how, balance)  # embed, head apart
    stages = _stages(chain, chosen["time"], "gpipe")
    losses = _step(stages, stages, ids, "gpipe")
    expected = _loss(ref(ids), ids)
    expected.backward()
    for loss in losses:
        torch.testing.assert_close(loss, expected.detach(), **TIGHT)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=name)


class CallsForward(GPT):
    """Calls its forward directly in ``training_step``: no module call for the profiler to see."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.forward(ids).sum()


def test_a_step_that_never_calls_the_plans_root_is_told_how_to_give_a_sample(monkeypatch):
    model = CallsForward()
    _, chain, _ = plan.check_model(model, plan.check_plan(PLAN), None, None, 2, 1)
    model.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    monkeypatch.setattr(balance_spec, "running_loop_data", lambda trainer: ("training_step", gpt_data()))
    with pytest.raises(
        ValueError, match=r"training_step did not call self\(\.\.\.\), whose forward is the plan's"
    ):
        balance_spec.sample_micro_batch(model, chain, "time", 4, CPU, lambda batch: batch)


class _BatchNormNet(pl.LightningModule):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), norm, torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.example_input_array = torch.randn(8, 16)


@pytest.mark.parametrize(("norm", "samples"), [(torch.nn.BatchNorm1d(32), 2), (torch.nn.LayerNorm(32), 1)])
def test_a_batch_norm_model_is_profiled_on_two_samples_or_more(norm, samples):
    """chunks 8 on a batch of 8: a model with BatchNorm (here frozen, which trains on micro-batches of one
    sample) is profiled on the first of 4 micro-batches (2 samples, the profile runs in training mode, where
    BatchNorm1d raises on one), and balance="time" on it runs; other models on the first of 8 (1 sample)."""
    model = _BatchNormNet(norm)
    model.layers[1].eval()
    sample = balance_spec.sample_micro_batch(model, model.layers, "time", 8, CPU, lambda batch: batch)
    torch.testing.assert_close(sample, model.example_input_array[:samples])
    assert len(balance_spec.balance_by_time(model.layers, sample, 2)) == 2
    assert not model.layers[1].training  # the user's mode is back
