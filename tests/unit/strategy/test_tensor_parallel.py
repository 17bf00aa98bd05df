"""The ``parallelize_stage`` hook on a one-process mesh: a plan applied to the stage's layers is kept; one
that raises, or that parallelizes a module outside the stage, is refused with the stage's layers and the
fix named. The multi-process behaviour is covered end to end (``test_tensor_parallel.py`` under
``tests/distributed``)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.partition.stage_items import StageItems
from lightning_gpipe.strategy.tensor_parallel import apply_plan, parallelize, unparallelize


@pytest.fixture
def tp_mesh():
    store = dist.TCPStore("127.0.0.1", find_free_network_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


class Model(nn.Module):
    """A rank's view under ``plan=``: ``head`` held by the stage, ``embed`` a part on another stage (empty
    here), ``extra`` an attribute the stage does not hold. ``how`` chooses what the hook does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.head = nn.Linear(4, 4)
        self.embed = StageItems({}, PipelineUsageError("part 'embed' is on stage 0"))
        self.extra = nn.Linear(4, 4)
        self.stage = nn.Sequential()
        self.stage.add_module("head", self.head)

    def parallelize_stage(self, stage, tp_mesh):
        if self.how == "none":  # names that match none of the stage's modules
            parallelize_module(stage, tp_mesh, {"lm_head": ColwiseParallel()})
            return
        if self.how == "raise":
            raise RuntimeError("my plan is broken")
        parallelize_module(self.head, tp_mesh, ColwiseParallel())
        if self.how == "elsewhere":
            parallelize_module(self.embed, tp_mesh, ColwiseParallel())
        if self.how == "extra":
            parallelize_module(self.extra, tp_mesh, ColwiseParallel())


def test_a_plan_on_the_stages_layers_is_kept_with_the_hooks_it_added(tp_mesh):
    model = Model("stage")
    x = torch.randn(3, 4)
    expected = model.head(x)
    added = apply_plan(model, model.stage, tp_mesh)
    assert isinstance(model.head.weight, DTensor)
    assert [m for m, pre, post in added if pre or post] == [model.head]
    torch.testing.assert_close(model.head(x), expected)  # one rank: the whole output


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("raise", r"Model.parallelize_stage\(stage, tp_mesh\) raised RuntimeError: my plan is broken"),
        ("elsewhere", r"raised NotImplementedError: .*(nn.Linear|Linear)"),
        ("extra", r"Model.parallelize_stage\(stage, tp_mesh\) parallelized extra, outside this rank's stage"),
    ],
)
def test_a_hook_that_raises_or_leaves_the_stage_is_refused_naming_the_stages_layers(tp_mesh, how, message):
    model = Model(how)
    with pytest.raises(PipelineUsageError, match=message) as caught:
        apply_plan(model, model.stage, tp_mesh)
    text = str(caught.value)
    assert "the stage holds the layers head" in text
    assert "apply the plan to the stage's layers" in text and "stage.children()" in text


def test_the_plan_taken_off_after_a_run_applies_again_for_the_next(tp_mesh):
    """``trainer.test`` after ``fit`` (or a second ``fit``) parallelizes the same layers again; torch's
    ``distribute_module`` refuses a module it has marked, so the mark goes with the plan."""
    model = Model("stage")
    model.stage.executor = SimpleNamespace()  # what parallelize gives the stage's DTensor wire
    x = torch.randn(3, 4)
    expected, state = model.head(x), {k: v.clone() for k, v in model.head.state_dict().items()}
    for _ in range(2):  # fit, then test: each takes the plan off at its end
        parallelize(model, model.stage, tp_mesh, 2)
        assert isinstance(model.head.weight, DTensor)
        torch.testing.assert_close(model.head(x), expected)
        unparallelize(model.stage)
        assert not isinstance(model.head.weight, DTensor) and not model.head._forward_hooks
        model.head.load_state_dict(state)  # the gathered state, as Pipelined.uninstall loads it
    torch.testing.assert_close(model.head(x), expected)


def test_a_plan_that_shards_nothing_on_the_stage_warns_naming_its_layers(tp_mesh):
    model = Model("none")
    with pytest.warns(UserWarning, match=r"left every parameter of this rank's stage \(layers head\) plain"):
        apply_plan(model, model.stage, tp_mesh)
    assert not isinstance(model.head.weight, DTensor)
