"""The input gradient first: a stage's last backward of a step sends the gradient of its input
before it computes its weight gradients (the B/W split of Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 2, applied to the drain).

At the end of every schedule's drain the stage before this one waits for the input gradient of
this stage's last backward, and this stage has nothing left to compute but that backward's weight
gradients. A single backward computes both in one pass and sends when it ends; split, the
gradient leaves after the input-gradient chain alone, the stage before starts its own last
backward that much earlier, and this stage computes its weight gradients meanwhile. With the MLP
benchmark (K = 2, M = 8, 1F1B) the step ends about a weight-gradient pass earlier
(BENCHMARKS.md section 22).

Two autograd passes over the same graph: ``torch.autograd.grad`` to the stage's inputs
(retaining the graph), then ``torch.autograd.backward`` to the stage's parameters. Each runs the
operations a single backward runs for what it asks, so the gradients are bit-identical; the cost
is the input-gradient chain above the first parameter, computed in both passes. Only the
parameters receive gradients in the second pass: a tensor that requires a gradient but is
neither a parameter nor a stage input is left without one (the optimizer steps parameters only).

Not split (one backward, as before): a micro-batch whose forward is recomputed (the recompute
would run in both passes), and a stage whose modules carry backward hooks, or when any module
does (``register_module_full_backward_hook``): they would run twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

__all__ = ["backward", "splits", "weights"]


def splits(modules: Sequence[nn.Module], recomputed: bool) -> bool:
    """Whether the backward of a micro-batch that ran through ``modules`` may be split: its forward
    is not recomputed and no module carries a backward hook (nor is one registered for every module)."""
    if recomputed or _module._global_backward_hooks or _module._global_backward_pre_hooks:
        return False
    return not any(m._backward_hooks or m._backward_pre_hooks for layer in modules for m in layer.modules())


def backward(
    outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]
) -> tuple[Tensor | None, ...]:
    """First pass: the gradients of ``inputs`` for ``outputs`` with ``grads`` (``None`` where an
    input does not reach an output); the graph is kept for :func:`weights`."""
    return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)


def weights(outputs: Sequence[Tensor], grads: Sequence[Tensor], parameters: Sequence[Tensor]) -> None:
    """Second pass: accumulate the gradients of ``parameters`` (those that require one) into their
    ``.grad``, as a single backward would; frees the graph."""
    params = [p for p in parameters if p.requires_grad]
    if params:
        torch.autograd.backward(outputs, grads, inputs=params)
