"""Skip connections across stages (torchgpipe's stash/pop idea), point-to-point from producer to consumer."""

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.skip import Pop, SkipError, Stash, routes
from tests.models import build_layers


def test_plain_sequential_runs_stash_and_pop_on_one_device():
    model = build_layers("unet")
    x = torch.randn(4, 6)
    enc = model[0](x)
    expected = model[5](torch.cat([model[3](model[2](model[1](enc))), enc], dim=-1))
    assert torch.allclose(model(x), expected)


def test_routes_from_layer_positions_and_errors():
    model = build_layers("unet")
    assert [(r.name, r.source, r.target) for r in routes(model, [0, 0, 1, 1, 2, 2])] == [("enc", 0, 2)]
    with pytest.raises(SkipError, match="never popped"):
        routes(nn.Sequential(Stash("a"), nn.Identity()), [0, 1])
    with pytest.raises(SkipError, match="popped by layer 0 before"):
        routes(nn.Sequential(Pop("a"), Stash("a")), [0, 1])
    with pytest.raises(SkipError, match="stashed twice"):
        routes(nn.Sequential(Stash("a"), Stash("a"), Pop("a")), [0, 0, 1])
