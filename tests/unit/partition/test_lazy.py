"""Lazy layers not yet called are refused before any process starts, naming them and the fix."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gpipe.errors import PartitionError
from lightning_gpipe.partition.lazy import check_initialized
from lightning_gpipe.strategy.pipelined import Pipelined, StageSpec


class _Lazy(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d(), nn.Tanh(), nn.Linear(8, 1))


def test_uncalled_lazy_layers_are_named_with_the_fix():
    with pytest.raises(PartitionError) as info:
        check_initialized(_Lazy())
    message = str(info.value)
    head = "_Lazy holds lazy layers not yet called (layers.0.weight, layers.0.bias, layers.1."
    assert message.startswith(head)
    assert "Call the model once on a batch before trainer.fit" in message


def test_the_strategy_refuses_them_before_the_cut_and_takes_them_once_called():
    """``Pipelined.check_model`` (run before any process starts) refuses the uncalled module; after one
    forward the same module is cut as its sized twin (2 stages, 2 layers each)."""
    module = _Lazy()
    spec = StageSpec(None, None, 2, "except_last", "gpipe", 1, False, False, 2.0, False)
    with pytest.raises(PartitionError, match="lazy layers not yet called"):
        Pipelined().check_model(module, spec, 2)
    with torch.no_grad():
        module.layers(torch.randn(4, 5))
    check_initialized(module)
    assert Pipelined().check_model(module, spec, 2)[2] == [2, 2]
