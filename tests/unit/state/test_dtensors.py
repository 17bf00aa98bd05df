"""Saved state of a tensor-parallel stage (issue 42, item 3): whole tensors out, each rank's shard back in;
on a one-process Gloo group (the multi-process save: tests/distributed/strategy/test_tensor_parallel.py)."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from lightning_gpipe.state.dtensors import full_tensors, shard_like
from lightning_gpipe.state.loading import load_model_state


def test_full_tensors_makes_every_dtensor_whole_in_nested_state(mesh):
    x, y = torch.randn(4, 3), torch.randn(5)
    state = {
        "a": distribute_tensor(x, mesh, [Shard(0)]),
        "b": [(distribute_tensor(y, mesh, [Replicate()]), 3)],
    }
    whole = full_tensors(state)
    assert type(whole["a"]) is torch.Tensor and torch.equal(whole["a"], x)
    assert (
        type(whole["b"][0][0]) is torch.Tensor and torch.equal(whole["b"][0][0], y) and whole["b"][0][1] == 3
    )


def test_shard_like_places_a_whole_tensor_as_its_target_and_leaves_the_rest(mesh):
    x = torch.randn(4, 3, dtype=torch.float64)
    target = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(1)])
    placed = shard_like(x, target)
    assert isinstance(placed, DTensor) and placed.placements == (Shard(1),) and placed.dtype == torch.float32
    assert torch.equal(placed.full_tensor(), x.float())
    assert shard_like(x, torch.zeros(4, 3)) is x  # a plain target
    assert shard_like(torch.randn(2), target).shape == (2,)  # another shape: left for the load to name
    assert shard_like(placed, target) is placed


def test_a_whole_state_dict_loads_into_a_parallelized_stage(mesh):
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    parallelize_module(stage[0], mesh, ColwiseParallel())
    whole = {
        k: torch.randn_like(v.full_tensor() if isinstance(v, DTensor) else v)
        for k, v in stage.state_dict().items()
    }
    load_model_state(stage, {**whole, "9.weight": torch.zeros(1)}, strict=True, lazy=None, partitioned=True)
    assert isinstance(stage[0].weight, DTensor)
    assert max_diff_whole(stage.state_dict(), whole) == 0.0


def max_diff_whole(state: dict, whole: dict) -> float:
    return max((full_tensors(v) - whole[k]).abs().max().item() for k, v in state.items())
