"""The last stage's loss reaches the pipeline only through the pipelined call's output; a penalty over
parameters or a stored activation is refused with the fix, before any backward (issue 40, kind A)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.schedule import fill_drain, one_f_one_b
from lightning_gpipe.strategy import steps
from lightning_gpipe.strategy.loss_graph import check_loss_graph
from lightning_gpipe.strategy.microstep import MicroSteps
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P
from tests.unit.strategy.test_microstep import Backward, StageModule


def test_a_loss_of_the_output_passes_and_a_penalty_or_a_stored_activation_is_refused():
    layer, x = nn.Linear(3, 2), torch.randn(4, 3)
    out = layer(x).detach().requires_grad_()  # the call's output leaf on the last stage
    module = nn.Sequential(layer)
    check_loss_graph(F.mse_loss(out, torch.zeros(4, 2)) + out.exp().sum() * 0, [out], module)
    with pytest.raises(
        PipelineUsageError, match=r"reaches the parameters '0.weight', '0.bias' other.*weight_decay=2 \* lam"
    ):
        check_loss_graph(out.sum() + 0.1 * sum(p.pow(2).sum() for p in module.parameters()), [out], module)
    stored = layer(x).pow(2).mean()  # an aux loss a layer kept from its forward
    with pytest.raises(PipelineUsageError, match=r"reaches the parameters .*lightning_gpipe.aux_loss"):
        check_loss_graph(out.sum() + stored, [out], module)
    inner = x.clone().requires_grad_()
    with pytest.raises(PipelineUsageError, match="a tensor inside the stage"):
        check_loss_graph(out.sum() + inner.sum(), [out], module)


class Module(StageModule):
    """A LightningModule's face over one stage: its parameters named as the model names them."""

    def named_parameters(self):
        return self.stage.named_parameters()


def _stage(schedule):
    torch.manual_seed(0)
    layers = [("0", nn.Linear(4, 4)), ("1", nn.Tanh()), ("2", nn.Linear(4, 1))]
    return PipelineStage(layers, StageTopology(0, 1, None, None), 2, "except_last", P2P(torch.device("cpu")),
                         schedule=schedule)  # fmt: skip


def _penalized(stage):
    def training_step(batch, batch_idx):
        x, y = batch
        return F.mse_loss(stage(x), y) + 0.05 * sum(p.pow(2).sum() for p in stage.parameters())

    return training_step


def test_a_penalty_over_the_parameters_is_refused_under_gpipe_and_1f1b_before_any_backward():
    """d03's L2 term over self.parameters(): refused by the step under "gpipe" (one call) and at the first
    call under "1f1b", with no gradient made."""
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    stage = _stage(fill_drain)
    pipelined, module = Pipelined(), Module(stage)
    pipelined.stage = stage
    run = functools.partial(stage.run_step, _penalized(stage), True)
    with pytest.raises(
        PipelineUsageError, match=r"reaches the parameters '0.weight', '0.bias', '2.weight' \(4 in all\)"
    ):
        steps.training_step(pipelined, run, module, False, batch, 0)
    stage = _stage(one_f_one_b)
    with pytest.raises(PipelineUsageError, match="reaches the parameter"):
        MicroSteps().training_step(_penalized(stage), stage, Module(stage), Backward(), 2, batch, 0)
    assert all(p.grad is None for p in stage.parameters())


def test_aux_losses_with_a_token_count_factor_are_refused():
    """num_items rescales a per-micro-batch step's gradients (its factor is not 1): declared aux losses
    would be rescaled too, so the pair is refused; either alone passes."""
    steps.check_aux_with_num_items(True, 1.0)
    steps.check_aux_with_num_items(False, 0.8)
    with pytest.raises(
        PipelineUsageError, match="num_items while layers declare aux losses.*schedule='gpipe'"
    ):
        steps.check_aux_with_num_items(True, 0.8)
