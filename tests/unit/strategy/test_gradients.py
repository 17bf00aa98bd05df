"""Gradient collectives on a one-process Gloo group: bucketed all-reduce and global-norm clipping.

With one process the reductions are identities, so what is tested is everything around them:
buckets split by size and dtype, flattening and unflattening back into every ``.grad``, the
division by the replica count, missing gradients, and the norm as ``torch.nn.utils`` computes it.
The multi-process behaviour is covered end to end (``test_lightning_features.py``).
"""

import math

import pytest
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.lightning import find_free_network_port

from lightning_gpipe.strategy.gradients import allreduce_gradients, clip_grad_norm_, global_grad_norm


@pytest.fixture
def world():
    store = dist.TCPStore("127.0.0.1", find_free_network_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _params():
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2), (7,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(4, dtype=torch.float64)))
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("bucket_bytes", [1, 40, 2**20])
def test_allreduce_averages_every_gradient_over_the_replicas_in_any_bucketing(world, bucket_bytes):
    params = _params()
    params[1].grad = None  # takes part as zeros
    expected = [p.grad / 4 if p.grad is not None else torch.zeros_like(p) for p in params]
    allreduce_gradients(params, world, replicas=4, bucket_bytes=bucket_bytes)
    for p, e in zip(params, expected):
        assert p.grad.dtype == e.dtype and torch.equal(p.grad, e)


def test_allreduce_with_one_replica_leaves_gradients_alone():
    params = _params()
    before = [p.grad.clone() for p in params]
    allreduce_gradients(params, None, replicas=1)  # no collective at all: no group needed
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_equals_torch_clip_grad_norm_on_one_device(world, norm_type, max_norm):
    ours, theirs = _params(), _params()
    total = clip_grad_norm_(ours, max_norm, norm_type, world, torch.device("cpu"))
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert torch.allclose(total.double(), expected.double(), rtol=1e-5)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_global_norm_of_a_stage_without_gradients_is_zero(world):
    params = [torch.nn.Parameter(torch.ones(2))]
    assert float(global_grad_norm(params, 2.0, world, torch.device("cpu"))) == 0.0
    assert float(global_grad_norm(params, math.inf, world, torch.device("cpu"))) == 0.0
