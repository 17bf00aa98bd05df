"""lightning_gpipe.engine.backward_split: the drain's last backward sends its input gradient before it
computes its weight gradients, with the gradients of a single backward, bit for bit."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine import backward_split as input_first
from lightning_gpipe.schedule import fill_drain, stage_actions
from tests.fakes import Recorder
from tests.unit.engine.test_executor import _step


class _Net(nn.Module):
    """Two inputs (an activation and a skip), one Linear used twice (tied), a frozen layer, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.tied, self.other, self.frozen = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x, skip):
        h = torch.tanh(self.tied(x)) + skip
        h = self.frozen(torch.relu(self.other(h)))
        return self.tied(h), h.sum(dim=1)


def _grads(split: bool):
    torch.manual_seed(0)
    net, x, skip = _Net(), torch.randn(5, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    for p in net.parameters():  # gradients of earlier micro-batches, accumulated onto
        p.grad = torch.randn_like(p) if p.requires_grad else None
    outputs = list(net(x, skip))
    grads = [torch.randn_like(t) for t in outputs]
    if split:
        two = input_first.Split.of(outputs, [x, skip], list(net.parameters()))
        assert two is not None
        before = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
        dx, dskip = two.inputs(grads)
        assert all(torch.equal(before[n], p.grad) for n, p in net.named_parameters() if n in before)
        two.weights()
        assert all(not torch.equal(before[n], p.grad) for n, p in net.named_parameters() if n in before)
    else:
        torch.autograd.backward(outputs, grads)
        dx, dskip = x.grad, skip.grad
    return dx, dskip, {n: p.grad for n, p in net.named_parameters()}


def test_two_passes_give_the_single_backward_gradients_bit_for_bit():
    split, single = _grads(True), _grads(False)
    assert torch.equal(split[0], single[0]) and torch.equal(split[1], single[1])
    assert split[2].keys() == single[2].keys()
    for name, g in single[2].items():
        assert (g is None and split[2][name] is None) or torch.equal(g, split[2][name]), name


def test_a_recomputed_forward_a_compiled_stage_or_a_backward_hook_keeps_one_backward():
    layers = input_first.every_module([nn.Sequential(nn.Linear(2, 2), nn.Tanh()), nn.Linear(2, 2)])
    assert len(layers) == 4  # the Sequential, its two layers and the last Linear
    assert input_first.splits(layers, recomputed=False)
    assert not input_first.splits(layers, recomputed=True)
    assert not input_first.splits(layers, recomputed=False, compiled=True)  # one node: both gradients at once
    handle = layers[2].register_full_backward_hook(lambda *args: None)  # on a module inside a layer
    assert not input_first.splits(layers, recomputed=False)
    handle.remove()
    handle = layers[3].register_full_backward_pre_hook(lambda *args: None)
    assert not input_first.splits(layers, recomputed=False)
    handle.remove()
    handle = nn.modules.module.register_module_full_backward_hook(lambda *args: None)  # every module
    try:
        assert not input_first.splits(layers, recomputed=False)
    finally:
        handle.remove()
    assert input_first.splits(layers, recomputed=False)


class _Spans(Recorder):
    """Every span, in order, as ``kind i``."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[str] = []

    @contextmanager
    def span(self, kind, i, u=0):
        self.spans.append(f"{kind} {i}")
        with super().span(kind, i, u):
            yield


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_only_the_drains_last_backward_sends_before_its_weights_and_the_step_equals_one_device(checkpoint):
    """Fill-drain over 3 stages, M = 3 (1F1B and interleaved: tests/test_transparency.py and the peer
    check): on stages 1 and 2 the column's last backward records its backward, its send, then its
    weights (unless its forward is recomputed: B0 under except_last); no other backward does, nor
    stage 0 (it sends no gradient). The gradients equal the unpartitioned model's."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    reference = [p.grad for p in _reference_grads(seq, x, y)]
    grid = fill_drain(3, 3)
    stages, _, _, _ = _step(seq, uniform_balance(3, 3), 3, x, y, checkpoint, recorder=_Spans)
    for stage in stages:
        j = stage.topology.stage
        last = [a for a in stage_actions(grid, j) if a.kind == "B"][-1]
        recomputed = checkpoint == "always" or (checkpoint == "except_last" and last.i < 2)
        split = j > 0 and not recomputed
        spans = stage.timeline.spans
        assert [s for s in spans if s.startswith("weights")] == ([f"weights {last.i}"] if split else [])
        if split:
            k = spans.index(f"weights {last.i}")
            assert spans[k - 2 : k] == [f"backward {last.i}", f"send {last.i}"], spans
    got = [p.grad for stage in stages for p in stage.parameters()]
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _reference_grads(seq, x, y):
    import copy

    plain = copy.deepcopy(seq)
    nn.functional.mse_loss(plain(x), y).backward()
    return list(plain.parameters())


class _Counted(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        return grad


class _Closure(nn.Module):
    """Uses another layer's weight through a plain attribute (not registered here)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.__dict__["borrowed"] = other

    def forward(self, x):
        return x @ self.borrowed.weight.t()


def _stack_grads(split: bool, closure: bool):
    torch.manual_seed(1)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    modules = [first, second, _Closure(first) if closure else nn.Identity()]
    x = torch.randn(3, 4, requires_grad=True)
    h = torch.tanh(first(x))
    h = _Counted.apply(h)  # between the layers: on the input chain, below the second's weight
    y = modules[2](torch.relu(second(h)))
    dy = torch.randn_like(y)
    _Counted.calls = 0
    if split:
        two = input_first.Split.of([y], [x], [p for m in modules for p in m.parameters()])
        assert two is not None
        dx = two.inputs([dy])[0]
        two.weights()
    else:
        y.backward(dy)
        dx = x.grad
    return dx, [first.weight.grad, first.bias.grad, second.weight.grad, second.bias.grad], _Counted.calls


@pytest.mark.parametrize("closure", [False, True])
def test_the_input_chain_runs_once_and_a_weight_used_through_another_layer_counts_both_uses(closure):
    """The second pass starts where each weight meets the input chain, so the chain between the layers
    runs once over both passes; a weight that a later layer uses through an unregistered reference gets
    the gradient of both uses, bit for bit (its second pass runs the chain between its uses again and
    keeps what the first pass found there)."""
    split, single = _stack_grads(True, closure), _stack_grads(False, closure)
    assert single[2] == 1 and split[2] == (2 if closure else 1)
    assert torch.equal(split[0], single[0])
    for a, b in zip(split[1], single[1]):
        assert torch.equal(a, b)


def test_a_graph_the_first_pass_cannot_cover_is_not_split():
    """No input needing a gradient (the first stage), an output reached by a weight without the input
    chain, a leaf output: Split.of declines, and the executor runs one backward."""
    layer, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    params = list(layer.parameters())
    assert input_first.Split.of([layer(x)], [], params) is None
    assert input_first.Split.of([layer(x), layer.weight * 2], [x], params) is None
    assert input_first.Split.of([layer(x), layer.weight], [x], params) is None
    assert input_first.Split.of([layer(x), x * 2], [x], params) is not None


def _hooked_grads(split: bool):
    torch.manual_seed(2)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = first(x)
    h.register_hook(lambda g: 2 * g)  # on an intermediate tensor: at the first weight's frontier node
    y = second(torch.tanh(h))
    dy = torch.randn_like(y)
    if split:
        two = input_first.Split.of([y], [x], [*first.parameters(), *second.parameters()])
        assert two is not None
        dx = two.inputs([dy])[0]
        two.weights()
    else:
        y.backward(dy)
        dx = x.grad
    return [dx, first.weight.grad, first.bias.grad, second.weight.grad]


def test_a_gradient_hook_on_an_intermediate_tensor_changes_the_gradient_once():
    for a, b in zip(_hooked_grads(True), _hooked_grads(False)):
        assert torch.equal(a, b)


def test_a_reentrant_checkpoint_inside_a_layer_is_not_split():
    """torch.utils.checkpoint(use_reentrant=True) refuses torch.autograd.grad: one backward instead."""
    from torch.utils.checkpoint import checkpoint

    layer, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
    y = checkpoint(layer, torch.tanh(x), use_reentrant=True)
    assert input_first.Split.of([y * 2], [x], list(layer.parameters())) is None
    assert input_first.Split.of([layer(torch.tanh(x))], [x], list(layer.parameters())) is not None


def test_a_non_leaf_input_and_a_parameter_the_micro_batch_does_not_use():
    """The walk finds the inputs and the parameters where the graph holds them: an input computed from
    another tensor (its node, not a leaf's) gets the single backward's gradient; a parameter of a layer
    this micro-batch skipped is left out (no gradient), the others equal one backward's bit for bit."""

    def run(split):
        torch.manual_seed(3)
        used, skipped = nn.Linear(4, 4), nn.Linear(4, 4)
        source = torch.randn(3, 4, requires_grad=True)
        x = source * 2  # a non-leaf stage input
        y = torch.tanh(used(x))
        dy = torch.randn_like(y)
        params = [*skipped.parameters(), *used.parameters()]
        if split:
            two = input_first.Split.of([y], [x], params)
            assert two is not None
            (dx,) = two.inputs([dy])
            two.weights()
        else:
            (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
            y.backward(dy)
        return dx, [p.grad for p in params]

    (dx, grads), (ref_dx, ref_grads) = run(True), run(False)
    assert torch.equal(dx, ref_dx)
    assert grads[:2] == [None, None] and ref_grads[:2] == [None, None]
    for a, b in zip(grads[2:], ref_grads[2:]):
        assert torch.equal(a, b)
