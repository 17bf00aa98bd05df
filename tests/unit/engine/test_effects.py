"""Recompute changes nothing but the arithmetic: every effect of a forward happens once per micro-batch.

In-process tests run one stage (no communication) with each checkpoint mode against
``checkpoint="never"``; one multi-process job runs the issue's failing input over 2 stages.
"""

import collections
import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.recompute import ForwardState, recomputing
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P
from tests.conftest import max_diff
from tests.models import Counter, EmaCenter, build_layers


def _train_one_stage(layers: nn.Sequential, checkpoint: str, steps: int = 3, chunks: int = 3):
    """``steps`` training steps of one stage over ``chunks`` micro-batches; returns the layers and
    gradients."""
    torch.manual_seed(0)
    stage = PipelineStage(
        list(layers._modules.items()),
        StageTopology(0, 1, None, None),
        chunks,
        checkpoint,
        P2P(torch.device("cpu")),
    )
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        x = torch.randn(9, 6, generator=g)
        stage.begin_step(True)
        out = stage(x)
        stage.end_step()
        out.pow(2).mean().backward()
        stage.backward()
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
        stage.zero_grad()
    return stage, grads


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_each_kind_of_forward_effect_happens_once_per_micro_batch(mode):
    """Buffers (in place, replaced), int/list attributes, a forward hook's counter, spectral norm's power
    iteration, a torchmetrics metric, an output that depends on a buffer the forward updates, dropout
    and the global RNG: all as with ``checkpoint="never"``."""
    torch.manual_seed(0)
    layers = build_layers("effects")
    never, never_grads = _train_one_stage(copy.deepcopy(layers), "never")
    ours, grads = _train_one_stage(copy.deepcopy(layers), mode)
    rng_never = torch.rand(3)  # the same seeds: equal iff the recompute left the global RNG alone
    assert int(ours[1].seen) == 27 == int(never[1].seen)  # 3 steps of 9 samples
    assert ours[1].effects() == never[1].effects() == {"calls": 9, "sizes": [3] * 9}
    assert ours[2].effects() == never[2].effects() == {"hook_calls": 9}
    assert ours[4].effects() == pytest.approx(never[4].effects())
    assert max_diff(ours.state_dict(), never.state_dict()) <= 1e-6  # EMA mean, spectral u/v, weights
    for a, b in zip(grads, never_grads):
        assert max_diff(a, b) <= 1e-6
    torch.manual_seed(0)
    _train_one_stage(copy.deepcopy(layers), mode)
    assert torch.equal(torch.rand(3), rng_never)


class _Replaces(nn.Module):
    """Replaces its buffer (``self.n = self.n + 1``) and creates an attribute on first use."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n = self.n + 1
        self.last_size = x.shape[0]
        return x * 2


def test_replaced_buffers_and_new_attributes_are_restored_after_recompute():
    layers = nn.Sequential(nn.Linear(6, 4), _Replaces())
    ours, _ = _train_one_stage(layers, "always", steps=2)
    assert float(ours[1].n) == 6.0 and ours[1].last_size == 3


class _Stats:
    """A plain object a layer keeps its counts in."""

    def __init__(self) -> None:
        self.n = 0


class _Holds(nn.Module):
    """Keeps one kind of state outside buffers and plain attributes, changed in training forward;
    ``shared`` is one object two layers hold. Its output depends on the state it read."""

    def __init__(self, kind: str, shared: object = None) -> None:
        super().__init__()
        self.kind = kind
        self.lock = threading.Lock()  # not copyable: kept by reference, never changed
        self.state: Any = {
            "defaultdict": lambda: collections.defaultdict(int),
            "deque": lambda: collections.deque(maxlen=4),
            "object": _Stats,
            "nested": lambda: {"a": [], "b": {"c": set()}},
            "shared": lambda: shared,
        }[kind]()

    def count(self) -> int:
        s = self.state
        if self.kind == "defaultdict":
            return s["n"]
        if self.kind == "deque":
            return sum(s)
        if self.kind == "nested":
            return len(s["a"]) + len(s["b"]["c"])
        return s.n

    def forward(self, x):
        if self.training:
            s, n = self.state, x.shape[0]
            if self.kind == "defaultdict":
                s["n"] += n
            elif self.kind == "deque":
                s.append(n)
            elif self.kind == "nested":
                s["a"].append(n)
                s["b"]["c"].add(len(s["a"]))
            else:
                s.n += n
        return x * (1 + 0.01 * self.count())


@pytest.mark.parametrize("mode", ["except_last", "always"])
@pytest.mark.parametrize("kind", ["defaultdict", "deque", "object", "nested", "shared"])
def test_containers_of_any_kind_and_plain_objects_change_once(kind, mode):
    """The rest of the kind "state a forward changes": a ``defaultdict``, a bounded ``deque``, a plain
    object, nested containers, and one object held by two layers (it stays one object in the
    recompute). Counts, outputs and gradients as with ``checkpoint="never"``; a lock the layer holds
    is kept as it is."""

    def build() -> nn.Sequential:
        shared = _Stats()
        return nn.Sequential(nn.Linear(6, 6), _Holds(kind, shared), nn.Tanh(), _Holds(kind, shared))

    never, never_grads = _train_one_stage(build(), "never")
    ours, grads = _train_one_stage(build(), mode)
    assert [ours[k].count() for k in (1, 3)] == [never[k].count() for k in (1, 3)]
    if kind == "shared":  # 3 steps of 9 samples, counted by both layers
        assert ours[1].state is ours[3].state and ours[1].count() == 54
    for a, b in zip(grads, never_grads):
        assert max_diff(a, b) <= 1e-6
    assert isinstance(ours[1].lock, type(threading.Lock()))


class _Collects(nn.Module):
    """Collects a statistic that is in the autograd graph (as an MoE router's balance term is) in a list
    the step reads and clears; ``alias`` names the same list holding a lock (``copy.deepcopy`` refuses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.aux: list[torch.Tensor] = []
        self.guarded = [1.0, 2.0, threading.Lock()]
        self.alias = self.guarded

    def forward(self, x):
        self.aux.append(x.pow(2).mean())
        return torch.tanh(self.lin(x)) * len(self.alias)


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_a_list_of_graph_tensors_and_an_uncopyable_alias_change_once(mode):
    """A list of tensors in the autograd graph is copied with the tensors kept (the recompute appends to
    the copy: 3 entries a step, as with ``checkpoint="never"``), and a container ``copy.deepcopy``
    refuses leaves no half-made copy behind for its alias: gradients as with ``never``."""

    def run(checkpoint: str):
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(6, 6), _Collects())
        stage = PipelineStage(
            list(layers._modules.items()),
            StageTopology(0, 1, None, None),
            3,
            checkpoint,
            P2P(torch.device("cpu")),
        )
        g = torch.Generator().manual_seed(1)
        counts, grads = [], []
        for _ in range(2):
            stage.begin_step(True)
            out = stage(torch.randn(9, 6, generator=g))
            stage.end_step()
            aux = torch.stack(layers[1].aux).mean()
            counts.append(len(layers[1].aux))
            layers[1].aux.clear()
            (out.pow(2).mean() + 0.1 * aux.detach()).backward()  # read, not backpropagated
            stage.backward()
            counts.append(len(layers[1].aux))  # what the recompute left
            grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
            stage.zero_grad()
        return counts, grads

    never_counts, never_grads = run("never")
    counts, grads = run(mode)
    assert counts == never_counts == [3, 0, 3, 0]
    for a, b in zip(grads, never_grads):
        assert max_diff(a, b) <= 1e-6


def test_recomputing_tells_hooks_with_outside_effects():
    """A hook that records into a list it closes over asks ``recomputing()``; it sees each
    micro-batch once."""
    seen: list[int] = []
    flags: list[bool] = []

    def hook(module, args, output):
        flags.append(recomputing())
        if not recomputing():
            seen.append(args[0].shape[0])

    layers = nn.Sequential(nn.Linear(6, 4), nn.Tanh())
    layers[0].register_forward_hook(hook)  # (a recompute stops once the last saved tensor is back)
    _train_one_stage(layers, "always", steps=1)
    assert seen == [3, 3, 3]
    assert flags.count(True) == 3 and not recomputing()


def test_forward_state_prunes_unchanged_tensors():
    """After the fill, copies are kept only for tensors the fill changed (here one of two buffers)."""
    counter, center = Counter(), EmaCenter(4)
    center.eval()  # does not update its mean
    state = ForwardState.capture([counter, center])
    counter.train()(torch.zeros(2, 4))
    state.prune()
    kept = {s.name for s in state._slots if isinstance(s.ref, torch.Tensor) and not s.pruned}
    assert kept == {"seen"}


def test_batch_norm_updates_running_statistics_once_per_micro_batch():
    """BatchNorm's in-place update leaves ``Tensor._version`` unchanged: the recompute must still
    not repeat it."""
    torch.manual_seed(0)
    layers = build_layers("bn")
    never, _ = _train_one_stage(copy.deepcopy(layers), "never")
    ours, _ = _train_one_stage(copy.deepcopy(layers), "always")
    assert int(ours[1].num_batches_tracked) == 9
    assert max_diff(ours.state_dict(), never.state_dict()) == 0.0
