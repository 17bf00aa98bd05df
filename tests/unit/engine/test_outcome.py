"""The step outcome carries the step's outputs to the other stages (lightning_gpipe.engine.outcome),
in one process."""

from collections import OrderedDict

import numpy as np
import pytest
import torch

from lightning_gpipe.engine.outcome import OutcomeChannel, StepOutcome
from tests.fakes import FakeNetwork, FakeP2P


def _travel(outputs, **outcome):
    network = FakeNetwork()
    sender = OutcomeChannel(FakeP2P(network, 0), torch.device("cpu"))
    receiver = OutcomeChannel(FakeP2P(network, 1), torch.device("cpu"))
    sent = StepOutcome(
        has_loss=True, loss=0.5, metrics={"acc": torch.tensor(0.25)}, outputs=outputs, **outcome
    )
    sender.send(sent, 1)
    return receiver.receive(0)


def test_outputs_travel_with_the_outcome_as_they_are():
    outputs = {
        "preds": torch.arange(6.0).reshape(3, 2),
        "n": 3,
        "stats": OrderedDict(mean=0.5, rows=[1.0, 2.0], tag="x", none=None, flag=True),
        "pair": (torch.tensor([1, 2]), "b"),
        7: torch.tensor(True),
    }
    got = _travel(outputs, gradient_scale=0.75)
    assert got.has_loss and got.loss == 0.5 and got.gradient_scale == 0.75
    assert got.metrics["acc"].item() == 0.25
    assert torch.equal(got.outputs["preds"], outputs["preds"]) and got.outputs["n"] == 3
    assert type(got.outputs["stats"]) is OrderedDict and got.outputs["stats"] == outputs["stats"]
    assert type(got.outputs["pair"]) is tuple and torch.equal(got.outputs["pair"][0], torch.tensor([1, 2]))
    assert got.outputs[7].item() is True
    assert _travel(None).outputs is None


def test_what_cannot_travel_arrives_as_none_with_a_warning():
    outputs = {"array": np.zeros(3), "many": [torch.zeros(2, 2) for _ in range(20)], "ok": torch.ones(1)}
    with pytest.warns(UserWarning, match=r"at \['array'\], \['many'\]\[9\], .* get None in its place"):
        got = _travel(outputs)
    assert got.outputs["array"] is None and torch.equal(got.outputs["ok"], torch.ones(1))
    many = got.outputs["many"]
    assert len(many) == 20 and all(torch.equal(t, torch.zeros(2, 2)) for t in many[:9])
    assert many[9:] == [None] * 11  # past what the message's header describes
