"""Aux losses that layers produce in forward (MoE load balancing, a VAE's KL, deep supervision), issue 40.

A layer declares its auxiliary loss by passing its output through :func:`aux_loss`:

.. code-block:: python

    def forward(self, x):
        p = torch.softmax(self.gate(x), dim=-1)
        y = x * p.max(dim=-1, keepdim=True).values
        return aux_loss(y, 0.1 * kl_per_sample.mean())  # y unchanged; the aux loss joins the backward

The output is returned unchanged; in backward the aux loss's gradient joins the layer's, scaled by
the weight of the micro-batch the forward computed (``n_i / N``, the micro-batch's share of the
batch), so each stage adds its own layers' aux losses to its micro-batch's backward. This is
Megatron-LM's ``MoEAuxLossAutoScaler`` (the aux loss attached to an activation by an autograd
function whose backward injects its gradient) and torchtitan's stage-local MoE aux loss. Outside a
pipeline's backward (one device) the weight is 1: the gradient is that of adding the aux loss to
the loss once per backward. A mean over samples (``kl_per_sample.mean()``) is then the same under
the pipeline as on one device; a function of batch statistics (the square of a batch mean) becomes
the weighted mean of its micro-batches' values, as under Megatron and torchtitan.

:func:`take_aux_losses` gives their value as one device would log it: the sum over the layers (over
every stage), each micro-batch's weighted by its share. :func:`check_stored_graph_tensors` refuses the
undeclared pattern on the stages before the last: a layer that keeps a tensor of the autograd graph
as an attribute (``self.aux_loss = ...``), which a loss computed after the pipelined call cannot reach
there (on the last stage, backpropagating it through the stage's graph a second time is refused by
the loss's graph check).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.recompute import recomputing
from lightning_gpipe.errors import PipelineUsageError

__all__ = [
    "add_recorded", "aux_loss", "aux_weight", "check_stored_graph_tensors", "recording_aux", "set_reducer",
    "submodules", "take_aux_losses",
]  # fmt: skip

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # hooks, _parameters, _buffers, _modules, training ...


class _State:
    """The process's aux-loss state: the weight a backward gives them, where forwards record their values."""

    weight = 1.0
    total: Tensor | None = None  # the values declared since the last take_aux_losses, summed where they live
    forward = threading.local()  # a pipeline stage's micro-batch forward: .records, .cell (recording_aux)
    reduce: Callable[[Tensor], Tensor] | None = None  # sums a value over a pipeline's stages


_STATE = _State()


class _AuxLoss(torch.autograd.Function):
    """Forward: ``output`` unchanged; backward: ``output``'s gradient, and the weight for the aux loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, loss: Tensor, cell: list[float] | None) -> Tensor:
        ctx.loss_shape, ctx.loss_dtype, ctx.cell = loss.shape, loss.dtype, cell
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        value = ctx.cell[0] if ctx.cell is not None else _STATE.weight  # the stage's, set before its backward
        weight = torch.full(ctx.loss_shape, value, dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, weight, None


def aux_loss(output: Tensor, loss: Tensor) -> Tensor:
    """``output`` unchanged, with the scalar ``loss`` (computed in the layer's forward) joining its backward.

    Args:
        output: the layer's output tensor (floating point; the value the layer returns).
        loss: a 0-d tensor: the aux loss, already multiplied by its coefficient.

    Returns:
        ``output``'s values; backpropagating through it also backpropagates ``loss`` with weight 1 on
        one device, with the micro-batch's share ``n_i / N`` in a pipeline stage's backward. Its
        value is recorded for :func:`take_aux_losses` when grad is enabled (training forwards).

    Raises:
        ValueError: ``loss`` is not a 0-d tensor, or ``output`` is not a floating-point tensor.
    """
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = list(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"aux_loss takes a 0-d tensor as the aux loss (got {shape}); reduce it (.mean())")
    if not isinstance(output, Tensor) or not output.is_floating_point():
        raise ValueError(
            "aux_loss attaches the aux loss to a floating-point output tensor of the layer (got "
            f"{getattr(output, 'dtype', type(output).__name__)}); pass the tensor the layer returns"
        )
    if not torch.is_grad_enabled():
        return output
    if not recomputing():  # a recomputed forward declares nothing new
        records = getattr(_STATE.forward, "records", None)
        if records is not None:
            records.append(loss.detach())
        else:
            add_recorded(loss)
    if not loss.requires_grad:
        return output
    return _AuxLoss.apply(output, loss, getattr(_STATE.forward, "cell", None))


def take_aux_losses() -> Tensor:
    """The sum of the aux losses declared (:func:`aux_loss`) in training forwards since the last call, then
    forgotten: a float64 0-d tensor on the CPU (0 when none).

    On one device, the batch's; under the gpipe strategy, the sum over every stage of the pipeline, each
    micro-batch's weighted by its share ``n_i / N``, once the step's backward has run (read it in
    ``on_train_batch_end`` or ``on_before_optimizer_step``). Under the strategy it is a collective over
    the pipeline's ranks: call it on every rank (at the same point, as in a hook every rank runs).
    """
    total = _STATE.total.cpu() if _STATE.total is not None else torch.zeros((), dtype=torch.float64)
    _STATE.total = None
    return _STATE.reduce(total) if _STATE.reduce is not None else total


def set_reducer(reduce: Callable[[Tensor], Tensor] | None) -> None:
    """:func:`take_aux_losses` sums over ``reduce`` (a pipeline's stages; ``None``: this process only)."""
    _STATE.reduce = reduce
    _STATE.total = None


@contextlib.contextmanager
def aux_weight(weight: float) -> Iterator[None]:
    """Inside: aux losses declared outside a pipeline stage's forward (one device) and backpropagated take
    ``weight`` rather than 1."""
    prior = _STATE.weight
    _STATE.weight = float(weight)
    try:
        yield
    finally:
        _STATE.weight = prior


@contextlib.contextmanager
def recording_aux(records: list[Tensor], cell: list[float]) -> Iterator[None]:
    """Inside (a stage's forward of one micro-batch, in this thread): :func:`aux_loss` records into
    ``records`` (weighted later by the stage), and its backward takes ``cell[0]`` as the weight, which the
    stage sets before the micro-batch's backward (in whichever thread autograd runs it)."""
    state = _STATE.forward
    prior = getattr(state, "records", None), getattr(state, "cell", None)
    state.records, state.cell = records, cell
    try:
        yield
    finally:
        state.records, state.cell = prior


def add_recorded(value: Tensor) -> None:
    """Add ``value`` (a declared aux loss, or a stage's weighted sum over its micro-batches) to what
    :func:`take_aux_losses` returns."""
    value = value.detach().to(torch.float64)  # summed on its device: no synchronization per call
    _STATE.total = value if _STATE.total is None else _STATE.total + value.to(_STATE.total.device)


def _graph_tensors(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a tensor, or a list, tuple or dict of them, two levels deep) holds a tensor
    of the autograd graph (one with a ``grad_fn``)."""
    if isinstance(value, Tensor):
        return value.grad_fn is not None
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_graph_tensors(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_graph_tensors(v, depth + 1) for v in value.values())
    return False


_STORED = (
    "an aux loss stored in forward for training_step to add? Under the gpipe strategy training_step runs "
    "after the pipelined call on the last stage only, once per batch, while layers run once per "
    "micro-batch: such a tensor never reaches the loss from this stage. Declare it in the layer's "
    "forward instead: `return lightning_gpipe.aux_loss(output, loss)` adds it to each micro-batch's "
    "backward on its own stage (docs/lightning.md, 'The whole model'); keep only detached values "
    "(`.detach()`) as attributes"
)


def submodules(layers: dict[str, nn.Module]) -> list[list[Any]]:
    """Every module of ``layers`` (their own included) by its name, for :func:`check_stored_graph_tensors`:
    ``[name, module, size of its __dict__, its attributes]``, the attributes listed again when the size
    changes."""
    return [[name, m, -1, []] for n, layer in layers.items() for name, m in layer.named_modules(prefix=n)]


def check_stored_graph_tensors(modules: list[list[Any]], stage: int) -> None:
    """Raise if a module keeps a tensor of the autograd graph as an attribute after a training forward on
    a stage other than the last (where the loss's graph check, :mod:`lightning_gpipe.strategy.loss_graph`,
    refuses backpropagating it; reading it detached there is fine).

    ``modules``: the stage's modules by their names in the user's Sequential (:func:`submodules`).
    Parameters, buffers and submodules are not attributes here; a detached tensor
    (``self.attn = attn.detach()``) is fine. The stage checks micro-batch 0's forward of each training
    step.

    Raises:
        PipelineUsageError: naming the layer and the attribute, and the fix (:func:`aux_loss`).
    """
    for entry in modules:
        module_name, module = entry[0], entry[1]
        attributes = module.__dict__
        if len(attributes) != entry[2]:
            entry[2], entry[3] = len(attributes), sorted(attributes.keys() - _MODULE_INTERNALS)
        for attr in entry[3]:
            value = attributes.get(attr)
            if isinstance(value, (Tensor, list, tuple, dict)) and _graph_tensors(value):
                where = f"layer {module_name} ({type(module).__name__}, on stage {stage})"
                raise PipelineUsageError(f"{where} kept a graph tensor in {attr!r}: {_STORED}")
