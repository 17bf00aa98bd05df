"""The gradient hooks' whole model (issue 40) over a stage holding ``DTensor`` parameters (issue 42, item 4),
in process: a one-rank tensor-parallel mesh."""

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_gpipe.strategy.whole_model import WholeParameters


def _stage_with_a_dtensor(mesh):
    """A module whose pipelined Sequential ``layers`` holds a ``DTensor`` weight with a gradient, and the
    pipelined view of its one stage."""
    module = nn.Module()
    module.layers = nn.Sequential(nn.Linear(3, 2, bias=False))
    weight = module.layers[0].weight
    dtensor = nn.Parameter(distribute_tensor(weight.detach().clone(), mesh, [Shard(0)]))
    dtensor.grad = distribute_tensor(torch.full((2, 3), 2.0), mesh, [Shard(0)])
    module.layers[0].weight = dtensor
    pipelined = SimpleNamespace(
        stages=1, installed=object(), running=module.layers, name="layers",
        plain_names=["layers.0.weight"], tied_aliases=dict,
    )  # fmt: skip
    return module, pipelined, dtensor


def test_a_dtensor_parameter_is_a_whole_plain_copy_in_the_hooks_and_a_hand_clip_reaches_its_shard(mesh):
    """With one stage the view is on for ``DTensor`` parameters: ``parameters()`` gives a plain copy of the
    whole value and gradient (what Lightning's ``grad_norm(self)`` can stack), and what the hook scales in
    the copy's gradient (a hand clip) is the parameter's gradient after the hook."""
    module, pipelined, dtensor = _stage_with_a_dtensor(mesh)
    view = WholeParameters(pipelined, None, lambda operation: None)
    with view.active(module):
        (copy,) = module.parameters()
        assert not isinstance(copy, DTensor) and not isinstance(copy.grad, DTensor)
        assert torch.equal(copy.detach(), dtensor.full_tensor())
        assert torch.equal(copy.grad, torch.full((2, 3), 2.0))
        assert [name for name, _ in module.named_parameters()] == ["layers.0.weight"]
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # the whole norm is 2·√6
    assert isinstance(module.layers[0].weight, DTensor)  # the module's own parameters after the hook
    expected = torch.full((2, 3), 2.0) / (2 * 6**0.5)
    assert torch.allclose(dtensor.grad.full_tensor(), expected, atol=1e-6)


def test_the_view_is_off_for_one_stage_of_plain_parameters(mesh):
    module = nn.Sequential(nn.Linear(3, 2))
    pipelined = SimpleNamespace(
        stages=1, installed=object(), running=module, name="", plain_names=[], tied_aliases=dict
    )
    view = WholeParameters(pipelined, None, lambda operation: None)
    with view.active(module):
        assert list(module.parameters()) == [module[0].weight, module[0].bias]
