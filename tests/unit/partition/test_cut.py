"""Cutting the user's Sequential into stages and installing a stage in its place."""

import torch
from torch import nn

from lightning_gpipe.partition.cut import cut, install, plain_parameter_names, uninstall
from lightning_gpipe.transport.layout import layer_stages


def test_cut_keeps_a_module_repeated_in_the_sequential():
    act = nn.Tanh()
    seq = nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act, nn.Linear(2, 1))
    assert [name for name, _ in cut(seq, [2, 3], 1)] == ["2", "3", "4"]
    assert cut(seq, [2, 3], 1)[1][1] is act


def test_layer_stages_lists_each_layers_stage():
    assert layer_stages([2, 1, 3]) == [0, 0, 1, 2, 2, 2]


def test_install_replaces_the_sequential_and_uninstall_restores_it_with_state():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Module()
            self.body.layers = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))

    net = Net()
    original = net.body.layers
    stage = nn.Sequential(original[0], original[1])
    installed = install(net, "body.layers", stage, deferred_batch_norm=True)
    assert net.body.layers is stage and type(stage[1]).__name__ == "DeferredBatchNorm"
    assert plain_parameter_names(installed.name, original) == [
        "body.layers.0.weight",
        "body.layers.0.bias",
        "body.layers.1.weight",
        "body.layers.1.bias",
    ]
    state = {k: torch.full_like(v, 7) for k, v in original.state_dict().items()}
    assert uninstall(installed, state) is original
    assert net.body.layers is original and isinstance(stage[1], nn.BatchNorm1d)
    assert all(torch.all(v == 7) for v in original.state_dict().values())
