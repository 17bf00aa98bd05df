"""Aux losses declared with ``aux_loss`` in a layer's forward join each stage's micro-batch backward and
train as on one device; a layer that stores a graph tensor is refused (issue 40, kind A).

The pipeline runs in one process (stages in threads over :mod:`tests.fakes`), driven as
tests/unit/engine/test_transparency.py drives it; one device is a deep copy of the model whose task
loss alone is backpropagated (the aux losses join through ``aux_loss``, weight 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe import PipelineUsageError, aux_loss, take_aux_losses
from lightning_gpipe.engine.aux_losses import aux_weight, check_stored_graph_tensors, submodules
from lightning_gpipe.engine.stage import StageDone
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import SCHEDULES
from lightning_gpipe.transport.layout import Layout
from tests.fakes import FakeNetwork, FakeP2P
from tests.unit.engine.test_transparency import TIGHT, _stages, _train_step


class KL(nn.Module):
    """A Linear whose forward declares a per-sample mean penalty of its output (a VAE-style KL) and an L2
    penalty over its own weight: both equal one device's whatever the micro-batches."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        y = self.linear(x)
        y = aux_loss(y, 0.3 * y.pow(2).sum(dim=1).mean())
        return aux_loss(y, 0.05 * self.linear.weight.pow(2).sum())


def _model() -> nn.Sequential:
    return nn.Sequential(KL(6), nn.Tanh(), nn.Linear(6, 8), nn.Tanh(), KL(8), nn.Linear(8, 3))


def test_aux_loss_on_one_device_is_the_term_added_to_the_loss():
    """One device: backpropagating through aux_loss's output adds the term's gradient with weight 1;
    inside aux_weight(w), with weight w; take_aux_losses gives the declared values' sum, then 0."""
    torch.manual_seed(0)
    layer, x = KL(4), torch.randn(5, 4)
    take_aux_losses()
    layer(x).sum().backward()
    declared = take_aux_losses()
    ours = layer.linear.weight.grad.clone()
    layer.zero_grad()
    y = layer.linear(x)
    (y.sum() + 0.3 * y.pow(2).sum(dim=1).mean() + 0.05 * layer.linear.weight.pow(2).sum()).backward()
    torch.testing.assert_close(ours, layer.linear.weight.grad)
    expected = 0.3 * y.detach().pow(2).sum(dim=1).mean() + 0.05 * layer.linear.weight.detach().pow(2).sum()
    torch.testing.assert_close(declared, expected.double())
    assert float(take_aux_losses()) == 0.0
    layer.zero_grad()
    out = layer(x)
    with aux_weight(0.0):
        out.sum().backward()
    torch.testing.assert_close(layer.linear.weight.grad, (torch.ones(5, 4).T @ x))
    assert float(take_aux_losses()) > 0.0  # the forward above declared
    with torch.no_grad():
        layer(x)  # evaluation declares nothing
    assert float(take_aux_losses()) == 0.0
    with pytest.raises(ValueError, match="0-d tensor"):
        aux_loss(x, x)


@pytest.mark.parametrize(
    ("k", "schedule", "checkpoint"),
    [
        (2, "gpipe", "except_last"),
        (2, "gpipe", "always"),
        (2, "1f1b", "never"),
        (3, "1f1b", "always"),
        (2, "zb_h1", "never"),
        (2, "interleaved_1f1b", "except_last"),
    ],
)
def test_declared_aux_losses_train_as_on_one_device(k, schedule, checkpoint):
    """Batch 10 in 3 micro-batches (4, 3, 3), aux losses on the first and the last stage: every gradient
    equals one device's, and the declared values summed over the stages (each micro-batch's weighted by
    n_i / N) equal one device's value."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    torch.manual_seed(0)
    seq = _model()
    ref = copy.deepcopy(seq)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    take_aux_losses()
    F.mse_loss(ref(x), y).backward()
    expected = take_aux_losses()
    stages = _stages(seq, k, 3, checkpoint, schedule, v)
    _train_step(stages, x, y, F.mse_loss, schedule, 3)
    for (name, p), q in zip(seq.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=name)
    torch.testing.assert_close(take_aux_losses(), expected, **TIGHT)


class Stores(nn.Module):
    def __init__(self, keep) -> None:
        super().__init__()
        self.linear, self.keep = nn.Linear(4, 4), keep

    def forward(self, x):
        y = self.linear(x)
        self.aux_loss = self.keep(y.pow(2).mean())
        self.history = [self.keep(y.sum())]
        return y


def test_a_layer_storing_a_graph_tensor_is_refused_with_the_fix():
    """A tensor of the graph kept as an attribute (or in a list) is refused, naming the layer, the
    attribute and aux_loss; a detached one, and anything under no_grad, is not."""
    layer = Stores(lambda t: t)
    layer(torch.randn(2, 4))
    with pytest.raises(
        PipelineUsageError, match=r"layer 3 \(Stores, on stage 1\).*'aux_loss'.*aux_loss\(output"
    ):
        check_stored_graph_tensors(submodules({"3": layer}), stage=1)
    layer.keep = lambda t: t.detach()
    layer(torch.randn(2, 4))
    check_stored_graph_tensors(submodules({"3": layer}), stage=1)
    layer.keep = lambda t: [t]
    layer(torch.randn(2, 4))
    with pytest.raises(PipelineUsageError, match="'aux_loss'"):
        check_stored_graph_tensors(submodules({"3": layer}), stage=1)


def test_a_stage_before_the_last_refuses_a_layer_storing_an_aux_loss_in_its_training_forward():
    """The d15 pattern inside the pipeline: stage 0 of 2 raises at its first training forward, naming the
    fix; its evaluation forward, and the last stage (whose training_step may read it detached), are fine."""
    seq = nn.Sequential(nn.Linear(4, 4), Stores(lambda t: t), nn.Linear(4, 4), Stores(lambda t: t))
    network = FakeNetwork()
    first, last = (build_stage(seq, [2, 2], Layout(2, 2), Layout(2, 2).rank(0, j), 2, "except_last",
                               torch.device("cpu"), SCHEDULES["gpipe"]) for j in (0, 1))  # fmt: skip
    first.p2p, last.p2p = FakeP2P(network, Layout(2, 2).rank(0, 0)), FakeP2P(network, Layout(2, 2).rank(0, 1))
    with pytest.raises(PipelineUsageError, match=r"layer 1 \(Stores, on stage 0\).*aux_loss"):
        first.run_step(first, True, torch.randn(4, 4))
    with torch.no_grad():
        assert first.run_step(first, False, torch.randn(4, 4)) is StageDone
        last.run_step(last, False, None)
