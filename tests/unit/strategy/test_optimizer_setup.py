"""configure_optimizers under the strategy: several optimizers are refused with one message that names
the fix, and an optimizer over other stages' layers only says what the stage sees."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gpipe.strategy.optimizer_setup import count_optimizers, setup_single_optimizer


def _sgd():
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


def test_count_optimizers_reads_every_form_lightning_accepts():
    opt, sched = _sgd(), None
    assert count_optimizers(opt) == 1
    assert count_optimizers({"optimizer": opt, "lr_scheduler": sched}) == 1
    assert count_optimizers([opt, _sgd()]) == 2
    assert count_optimizers(([opt, _sgd()], [])) == 2
    assert count_optimizers([{"optimizer": opt}, {"optimizer": _sgd()}]) == 2
    assert count_optimizers(None) == 0


class _Module(pl.LightningModule):
    def __init__(self, conf):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.conf = conf

    def configure_optimizers(self):
        return self.conf(self)


def _strategy(module, optimizers=()):
    return SimpleNamespace(
        lightning_module=module,
        collective_timeout=5.0,
        stage_index=1,
        global_rank=0,
        optimizers=list(optimizers),
    )


def test_several_optimizers_are_refused_naming_the_count_and_the_fix():
    module = _Module(
        lambda m: [torch.optim.SGD(m.layers[0].parameters()), torch.optim.SGD(m.layers[1].parameters())]
    )

    def lightning_setup():  # as Lightning's setup_optimizers under automatic optimization
        module.configure_optimizers()
        raise RuntimeError("Training with multiple optimizers is only supported with manual optimization")

    with pytest.raises(
        ValueError, match=r"returned 2 optimizers \(on stage 1 \(rank 0\)\); .* single optimizer"
    ):
        setup_single_optimizer(_strategy(module), lightning_setup, nullcontext())
    assert "configure_optimizers" not in vars(module)  # the counting wrapper is gone


def test_an_optimizer_without_parameters_on_this_stage_says_what_the_stage_sees():
    module = _Module(lambda m: torch.optim.SGD([p for p in m.parameters() if p.dim() == 3], lr=0.1))
    with pytest.raises(ValueError, match="sees only this stage's layers") as caught:
        setup_single_optimizer(_strategy(module), module.configure_optimizers, nullcontext())
    assert "empty parameter list" in str(caught.value.__cause__)


def test_one_optimizer_sets_up():
    module = _Module(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    ran = []
    setup_single_optimizer(
        _strategy(module, [object()]), lambda: ran.append(module.configure_optimizers()), nullcontext()
    )
    assert len(ran) == 1 and isinstance(ran[0], torch.optim.SGD)
