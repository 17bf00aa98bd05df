"""The benchmark workloads: the models, their mini-batches and their losses.

``model`` is the ``model`` node of ``benchmarks/conf/benchmark.yaml`` as a dict: ``name`` is
``"mlp"`` (a compute-bound stack of ``num_layers`` × ``GELU(Linear(width, width))``) or
``"transformer"`` (:func:`recipes.models.transformer.build_transformer`, the recipe's decoder-only
LM with ``num_layers`` blocks). Used by the driver (:mod:`benchmarks.benchmark`: profiling,
capacity) and by every run of the worker (:mod:`benchmarks.worker`), so that all runs train the
same model on the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Batch", "LinearGELU", "build_model", "loss_fn", "make_batches", "summed_loss_fn"]

Batch = tuple[Tensor, Tensor]


class LinearGELU(nn.Module):
    """``GELU(Linear(x))``, ``(N, width)`` → ``(N, width)``: one layer of the compute-bound stack."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.linear(x))


def build_model(model: dict[str, Any]) -> nn.Sequential:
    """``model["name"]``: ``"mlp"`` (``num_layers`` × :class:`LinearGELU` of ``width``) or
    ``"transformer"`` (:func:`recipes.models.transformer.build_transformer`, ``num_layers`` blocks)."""
    torch.manual_seed(0)
    if model["name"] == "mlp":
        return nn.Sequential(*[LinearGELU(model["width"]) for _ in range(model["num_layers"])])
    if model["name"] == "transformer":
        from recipes.models.transformer import build_transformer

        return build_transformer(
            model["vocab_size"],
            model["num_layers"],
            model["d_model"],
            model["num_heads"],
            model["d_ff"],
            model["seq_len"],
            0.0,
        )
    raise ValueError(f"model.name must be 'mlp' or 'transformer' (model.name: {model['name']!r})")


def make_batches(model: dict[str, Any], batch_size: int, count: int = 2) -> list[Batch]:
    """``count`` distinct mini-batches ``(x, y)``: mlp ``(N, width)`` floats; transformer ``(N, T)`` ids."""
    g = torch.Generator().manual_seed(1)
    if model["name"] == "mlp":
        shape = (batch_size, model["width"])
        return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(count)]
    shape = (batch_size, model["seq_len"])
    vocab = model["vocab_size"]
    return [
        (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
        for _ in range(count)
    ]


def loss_fn(model: dict[str, Any]) -> Callable[[Tensor, Tensor], Tensor]:
    """The mean loss of a mini-batch: MSE (mlp) or token cross-entropy (transformer)."""
    if model["name"] == "mlp":
        return F.mse_loss
    return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


def summed_loss_fn(model: dict[str, Any], batch_size: int) -> Callable[[Tensor, Tensor], Tensor]:
    """Per micro-batch, its share of the mini-batch's mean loss (the peer sums micro-batch losses)."""
    if model["name"] == "mlp":
        return lambda out, y: F.mse_loss(out, y, reduction="sum") / (batch_size * y.shape[-1])
    return lambda out, y: (
        F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / (batch_size * y.shape[-1])
    )
