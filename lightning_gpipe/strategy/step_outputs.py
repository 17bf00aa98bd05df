"""A step's output from its micro-batch calls: what ``training_step`` returns, combined into the batch's.

Under every schedule but ``"gpipe"`` ``training_step`` runs once per micro-batch
(:mod:`lightning_gpipe.strategy.microstep`), but Lightning's hooks (``on_train_batch_end(outputs,
...)``) get one output per batch. The calls' outputs are combined here into the one a single call
on the whole batch gives, entry by entry, each call ``i`` weighted like its loss, ``w_i``:

- the loss: ``Σ w_i · loss_i``, with ``w_i = n_i / N`` (the call's share of the batch's samples);
  a token-count loss (below), ``w_i = k_i / K``;
- a tensor with a dimension: the calls' concatenated along dim 0 (``M × (n_i, *)`` → ``(N, *)``:
  predictions, targets, per-sample values);
- a number (``float``, ``int``, or a 0-d tensor): a floating one, the mean weighted like the loss
  (``Σ w_i · v_i``, calls with ``w_i = 0`` left out: a batch mean); an integer one, the sum (a
  count: samples, correct predictions, tokens);
- a dict, a list or a tuple: entry by entry; a list holding no tensor whose length is its call's
  micro-batch size in every call (per-sample values, ``preds.tolist()``): concatenated;
- anything else (``str``, ``bool``, ``None``, other objects), tensors whose shapes beyond dim 0
  differ, and containers whose keys or lengths differ between calls: the last call's.

**Token-count losses.** A loss that is a mean over a count that differs between micro-batches
(cross-entropy over the valid tokens of padded sequences, ``ignore_index=-100``) is not the batch's
mean when the micro-batch means are weighted by samples. ``training_step`` may return
``{"loss": loss, "num_items": k}``, ``loss`` a mean over ``k`` items (an ``int`` or a 0-d tensor);
each call's loss is then weighted by ``k_i / K``, ``K = Σ k_i``, as Hugging Face's
``num_items_in_batch`` and torchtitan's global token count weight theirs, so that the step trains
and logs exactly as one device does with the same code (on one device the extra key is harmless).
``K`` is known only after the last call, while each call's backward runs right after it: the calls
backpropagate ``loss_i · k_i / (M · k_ref)`` (``k_ref`` the first call's nonzero count, so that the
gradients keep the magnitude the ``n_i / N`` weights give them) and the step's gradients are then
multiplied by :func:`gradient_scale` ``= M · k_ref / K`` on every stage before they join the
parameters'. A call with ``k_i = 0`` (every target ignored: its mean is NaN) backpropagates nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_gpipe.errors import PipelineUsageError

__all__ = [
    "IGNORE_INDEX",
    "combine",
    "combine_outputs",
    "gradient_scale",
    "ignores_targets",
    "loss_weights",
    "num_items_of",
    "without_loss",
]

NUM_ITEMS = "num_items"


def num_items_of(out: Any, i: int) -> float | None:
    """The ``"num_items"`` of call ``i``'s output ``out`` (``None``: none returned).

    Raises:
        PipelineUsageError: ``num_items`` is not a number, a 0-d tensor or a one-element tensor, or
            is negative.
    """
    if not isinstance(out, Mapping) or out.get(NUM_ITEMS) is None:
        return None
    k = out[NUM_ITEMS]
    if isinstance(k, Tensor) and k.numel() == 1:
        k = k.item()
    if isinstance(k, bool) or not isinstance(k, (int, float)) or k < 0:
        raise PipelineUsageError(
            f"training_step returned num_items={k!r} for micro-batch {i}; num_items is the count of "
            "items (e.g. valid tokens) the returned loss is a mean over: a non-negative int or a 0-d tensor"
        )
    return float(k)


def loss_weights(sizes: Sequence[int], items: Sequence[float | None]) -> list[float]:
    """Each call's weight ``w_i`` in the step's loss: ``k_i / K`` where every call returned
    ``num_items``, else ``n_i / N`` (``sizes``: the calls' micro-batch sizes ``n_i``).

    Raises:
        PipelineUsageError: some calls returned ``num_items`` and others did not.
    """
    given = [k is not None for k in items]
    if any(given) and not all(given):
        calls = [i for i, g in enumerate(given) if not g]
        raise PipelineUsageError(
            f"training_step returned num_items for some micro-batches but not for micro-batches {calls}; "
            "return it from every call (0 where the micro-batch has no item) or from none"
        )
    if any(given):
        total = sum(float(k) for k in items if k is not None)
        return [float(k) / total if total else 0.0 for k in items if k is not None]
    n = sum(sizes)
    return [s / n for s in sizes]


def gradient_scale(items: Sequence[float | None], calls: int) -> tuple[float | None, float]:
    """``(k_ref, scale)``: the count the calls' backwards are normalised by (``None``: no call has
    items yet, or no ``num_items``) and the factor the step's gradients take at its end
    (``M · k_ref / K``; 1 without ``num_items``), for the counts ``items`` seen so far."""
    counts = [k for k in items if k is not None]
    first = next((k for k in counts if k > 0), None)
    total = sum(counts)
    if first is None or not total:
        return first, 1.0
    return first, calls * first / total


def without_loss(out: Any) -> dict[str, Any] | None:
    """A call's dict output less its loss, its tensors detached and copied (they outlive the call);
    ``None`` for a tensor output."""
    if not isinstance(out, Mapping):
        return None
    return {k: apply_to_collection(v, Tensor, _owned) for k, v in out.items() if k != "loss"}


def _owned(t: Tensor) -> Tensor:
    return t.detach().clone()


def combine(values: Sequence[Any], weights: Sequence[float], sizes: Sequence[int]) -> Any:
    """The calls' ``values`` of one entry combined into the batch's (the module docstring's rule).

    Args:
        values: call ``i``'s value of the entry, per call.
        weights: the calls' loss weights ``w_i`` (:func:`loss_weights`).
        sizes: the calls' micro-batch sizes ``n_i``.
    """
    last = values[-1]
    if len(values) == 1:
        return last
    if all(isinstance(v, Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return _number(values, weights)
        try:
            return torch.cat(list(values), dim=0)
        except RuntimeError:
            return last
    if all(_is_number(v) for v in values):
        return _number(values, weights)
    kind = type(last)
    if any(type(v) is not kind for v in values):
        return last
    if kind in (dict, OrderedDict):
        if any(list(v) != list(last) for v in values):
            return last
        return kind((key, combine([v[key] for v in values], weights, sizes)) for key in last)
    if kind is list and _per_sample(values, sizes):
        return [x for v in values for x in v]
    if kind in (list, tuple) and all(len(v) == len(last) for v in values):
        return kind(combine([v[j] for v in values], weights, sizes) for j in range(len(last)))
    return last


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_sample(values: Sequence[list[Any]], sizes: Sequence[int]) -> bool:
    """Lists of per-sample values: no tensor inside, each as long as its call's micro-batch."""
    found: list[Tensor] = []
    apply_to_collection(list(values), Tensor, found.append)
    return not found and all(len(v) == n for v, n in zip(values, sizes))


def _number(values: Sequence[Any], weights: Sequence[float]) -> Any:
    """Numbers (Python or 0-d tensors) of the calls: floating, the mean weighted like the loss;
    integer, the sum; ``bool``, the last call's."""
    last = values[-1]
    tensor = isinstance(last, Tensor)
    dtype = last.dtype if tensor else None
    if any(isinstance(v, Tensor) and (v.dtype == torch.bool or v.is_complex()) for v in values):
        return last
    floating = any((isinstance(v, Tensor) and v.is_floating_point()) or isinstance(v, float) for v in values)
    as_float = [float(v) if not isinstance(v, Tensor) else v.detach().double().item() for v in values]
    if not floating:
        total_int = sum(int(v) for v in as_float)
        return torch.tensor(total_int, dtype=dtype, device=last.device) if tensor else total_int
    kept = [(w, v) for w, v in zip(weights, as_float) if w > 0]
    if not kept:
        return last
    mean = sum(w * v for w, v in kept) / sum(w for w, _ in kept)
    return torch.tensor(mean, dtype=dtype, device=last.device) if tensor else mean


def combine_outputs(
    kept: Sequence[dict[str, Any] | None], weights: Sequence[float], sizes: Sequence[int]
) -> Any:
    """The calls' dict outputs less their losses (:func:`without_loss`) combined (:func:`combine`);
    ``"num_items"`` is summed whatever its type (a float count too)."""
    combined = combine(kept, weights, sizes)
    counts = [k.get(NUM_ITEMS) if isinstance(k, Mapping) else None for k in kept]
    if isinstance(combined, dict) and len(kept) > 1 and all(c is not None for c in counts):
        if all(isinstance(c, Tensor) for c in counts):
            combined[NUM_ITEMS] = torch.stack([torch.as_tensor(c).reshape(()) for c in counts]).sum()
        else:
            combined[NUM_ITEMS] = sum(c.item() if isinstance(c, Tensor) else c for c in counts)
    return combined


IGNORE_INDEX = -100
"""The target value PyTorch's and Hugging Face's losses ignore by default (``ignore_index``)."""


def ignores_targets(batch: Any) -> bool:
    """Whether ``batch`` holds an integer tensor with :data:`IGNORE_INDEX` values: targets that a mean
    loss over the others leaves out, so that micro-batches count different numbers of them."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    integer = [t for t in found if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    return any(bool((t == IGNORE_INDEX).any()) for t in integer)
