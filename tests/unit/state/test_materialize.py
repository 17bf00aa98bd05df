"""The large-model path: built on the meta device, each rank materializes, loads and holds only its stage."""

import pytest
import torch
from torch import nn

from lightning_gpipe.state.materialize import initialize_layer, layer_seed


def test_layer_streams_are_the_eager_constructors_under_their_seed():
    """A materialized Linear equals nn.Linear built right after torch.manual_seed(layer_seed(seed, k))."""
    with torch.device("meta"):
        layer = nn.Linear(5, 3)
    state = torch.get_rng_state()
    initialize_layer(layer, layer_seed(7, 2))
    assert torch.equal(torch.get_rng_state(), state), "the caller's random state is left as it was"
    torch.manual_seed(layer_seed(7, 2))
    eager = nn.Linear(5, 3)
    assert torch.equal(layer.weight, eager.weight) and torch.equal(layer.bias, eager.bias)
    assert layer_seed(7, 2) != layer_seed(7, 3) and layer_seed(7, 2) != layer_seed(8, 2)


def test_a_module_without_reset_parameters_is_refused_by_name():
    with torch.device("meta"):
        attention = nn.MultiheadAttention(4, 2)
    with pytest.raises(
        TypeError, match="MultiheadAttention holds parameters or buffers built on the meta device"
    ):
        initialize_layer(attention, 0)


class Gain(nn.Module):
    """A parameter and a buffer of its own, and no reset_parameters (as a transformers RMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("table", torch.empty(2), persistent=False)


def test_a_layers_initializer_initializes_each_of_its_meta_modules_from_the_layers_stream():
    # causal_lm's layers carry the transformers model's _init_weights as initialize_module (issue 39)
    with torch.device("meta"):
        layer = nn.Sequential(Gain(), nn.Linear(3, 3))
    seen = []

    def init(module: nn.Module) -> None:
        assert not any(t.is_meta for t in layer.parameters())  # every module has storage first
        seen.append(type(module).__name__)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.data.normal_()

    layer.__dict__["initialize_module"] = init
    state = torch.get_rng_state()
    initialize_layer(layer, layer_seed(0, 4))
    assert torch.equal(torch.get_rng_state(), state)
    assert seen == ["Gain", "Linear"]  # each module holding tensors, in modules() order, the layer not
    torch.manual_seed(layer_seed(0, 4))  # the draws of the layer's own stream, in that order
    expected = [torch.randn(3), torch.randn(2), torch.randn(3, 3), torch.randn(3)]
    got = [layer[0].weight, layer[0].table, layer[1].weight, layer[1].bias]
    for value, tensor in zip(expected, got):
        assert torch.equal(tensor, value)
