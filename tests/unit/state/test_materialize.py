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
