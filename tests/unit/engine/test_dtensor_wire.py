"""DTensors between stages (issue 42, item 3): a DTensor travels as its local tensor, placements and global
shape through the message codec, and is rebuilt over the receiving stage's mesh with gradients reaching the
received leaf; on a one-process Gloo group (the multi-process exchange: tests/distributed/strategy/
test_tensor_parallel.py)."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from lightning_gpipe.engine.dtensor_wire import MARK, from_wire, to_wire
from lightning_gpipe.engine.microbatch import flatten, unflatten
from lightning_gpipe.engine.stage import StageDone
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.wire import decode_structure, encode_structure
from tests.fakes import FakeNetwork, FakeP2P


def _travel(value):
    """``value`` through the message codec: its tensors apart, its structure as the JSON blob."""
    tensors, structure = flatten(value, "a stage's output")
    received = decode_structure(encode_structure(structure), structure.whole)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    return unflatten(received, leaves), leaves


@pytest.mark.parametrize(
    ("placement", "code"),
    [(Shard(1), "S:1"), (Shard(0), "S:0"), (Replicate(), "R"), (Partial("sum"), "P:sum")],
)
def test_a_dtensor_arrives_with_its_placements_shape_and_values(mesh, placement, code):
    x = torch.randn(4, 6)
    d = DTensor.from_local(x, mesh, [placement])
    value, _ = _travel({"h": to_wire(d), "mask": torch.ones(4, dtype=torch.bool), "scale": 0.5})
    assert value["h"][MARK] == [code] and value["scale"] == 0.5
    rebuilt = from_wire(value, mesh)["h"]
    assert isinstance(rebuilt, DTensor) and rebuilt.placements == (placement,)
    assert rebuilt.shape == d.shape and rebuilt.stride() == d.stride()
    assert torch.equal(rebuilt.full_tensor(), x)


def test_gradients_of_the_rebuilt_dtensor_reach_the_received_leaf_and_the_sent_one(mesh):
    weight = torch.randn(4, 6)
    source = torch.randn(4, 6, requires_grad=True)
    sent = to_wire(DTensor.from_local(source, mesh, [Shard(1)]))  # the sender's graph runs through to_local
    value, (leaf,) = _travel(sent)
    out = from_wire(value, mesh)
    (out * distribute_tensor(weight, mesh, [Shard(1)])).sum().backward()
    assert torch.equal(leaf.grad, weight)  # the received local tensor's gradient: what travels back
    sent["local"].backward(leaf.grad)  # the sender backpropagates it into its DTensor
    assert torch.equal(source.grad, weight)


def test_values_without_dtensors_travel_as_they_are(mesh):
    x = torch.randn(2, 3)
    assert to_wire(x) is x and from_wire(x, None) is x
    value = (x, {"n": 3})
    assert to_wire(value) == value and from_wire(value, mesh) == value


def test_a_dtensor_on_a_stage_without_a_tensor_parallel_mesh_is_refused_with_the_fix(mesh):
    wired = to_wire(distribute_tensor(torch.randn(2, 2), mesh, [Replicate()]))
    with pytest.raises(
        PipelineUsageError, match=r"placements \['R'\] .* no tensor-parallel mesh.*use_local_output"
    ):
        from_wire((wired,), None)


class _Odd(Placement):
    def __repr__(self) -> str:
        return "_Odd()"


def test_a_placement_that_cannot_travel_is_refused_naming_it(mesh):
    d = distribute_tensor(torch.randn(2, 2), mesh, [Replicate()])
    odd = DTensor.from_local(d.to_local(), mesh, [Replicate()])
    odd._spec.placements = (_Odd(),)
    with pytest.raises(
        PipelineUsageError, match=r"placement _Odd\(\).*Shard\(dim\), Replicate\(\) and Partial"
    ):
        to_wire(odd)


class PlainP2P(FakeP2P):
    """The fake transport, refusing what ``torch.distributed``'s point-to-point operations cannot carry: a
    tensor subclass such as ``DTensor`` (its local shard would travel under its global shape's header)."""

    def send(self, tensors, dst, **kwargs):
        assert all(type(t) is torch.Tensor for t in tensors), [type(t).__name__ for t in tensors]
        super().send(tensors, dst, **kwargs)


def test_a_dtensor_output_crosses_stages_through_the_executor_as_on_one_device(mesh):
    """Two stages in one process (tests/fakes.py): stage 0 ends in a colwise Linear whose output stays a
    ``Shard(-1)`` DTensor, stage 1 starts with a rowwise Linear that takes it; loss and gradients equal the
    plain Sequential's, under fill-drain with recompute."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    seq = copy.deepcopy(plain)
    parallelize_module(seq[0], mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(seq[2], mesh, RowwiseParallel())
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    network, stages = FakeNetwork(), []
    for j in range(2):
        stage = build_stage(
            seq, [1, 2], Layout(2, 2), Layout(2, 2).rank(0, j), 4, "except_last", torch.device("cpu")
        )
        stage.p2p, stage.timeline, stage.executor.tensor_mesh = (
            PlainP2P(network, stage.topology.ranks[j]),
            None,
            mesh,
        )
        stages.append(stage)
    assert stages[0].run_step(stages[0], True, x) is StageDone
    out = stages[1].run_step(stages[1], True, x)
    loss = nn.functional.mse_loss(out, y)
    assert stages[1].share_outcome(loss, None, training=True) is not None
    assert stages[0].share_outcome(None, None, training=True) is not None
    loss.backward()
    for stage in reversed(stages):
        stage.backward()
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    for (name, p), q in zip(seq.named_parameters(), plain.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert torch.allclose(grad, q.grad, atol=1e-6), name
