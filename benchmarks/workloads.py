"""The benchmark workloads: the models, their mini-batches and their losses.

``model`` is the ``model`` node of ``benchmarks/conf/benchmark.yaml`` as a dict: ``name`` is
``"mlp"`` (a compute-bound stack of ``num_layers`` × ``GELU(Linear(width, width))``) or
``"transformer"`` (:func:`recipes.models.transformer.build_transformer`, the recipe's decoder-only
LM with ``num_layers`` blocks). Used by the driver (:mod:`benchmarks.benchmark`: profiling,
capacity) and by every run of the worker (:mod:`benchmarks.worker`), so that all runs train the
same model on the same data.

:func:`build_llama` is the Llama-style model of :mod:`benchmarks.mesh` (RMSNorm, attention with
q/k/v/o projections, a SwiGLU MLP per block) and :data:`LLAMA_BLOCK_PLAN` its blocks' standard
colwise/rowwise tensor-parallel plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = [
    "LLAMA_BLOCK_PLAN",
    "Batch",
    "LinearGELU",
    "LlamaAttention",
    "LlamaBlock",
    "SwiGLU",
    "build_llama",
    "build_model",
    "loss_fn",
    "make_batches",
    "summed_loss_fn",
]

Batch = tuple[Tensor, Tensor]


class LinearGELU(nn.Module):
    """``GELU(Linear(x))``, ``(N, width)`` → ``(N, width)``: one layer of the compute-bound stack."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.linear(x))


class LlamaAttention(nn.Module):
    """Causal self-attention with q/k/v/o projections (no bias), ``(N, T, dim)`` → ``(N, T, dim)``.

    The heads are ``dim // head_dim`` on one device; under tensor parallelism (q/k/v colwise) a rank
    holds its share of them, hence the ``-1`` in the view.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = (p(x).view(n, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(n, t, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (no bias), ``(N, T, dim)`` → ``(N, T, dim)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """A pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, RMSNorm."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), LlamaAttention(dim, heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _llama_plan() -> dict[str, Any]:
    colwise = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
    return {
        **{name: ColwiseParallel() for name in colwise},
        "attn.o": RowwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }


LLAMA_BLOCK_PLAN: dict[str, Any] = _llama_plan()
"""The standard tensor-parallel plan of a :class:`LlamaBlock`: q/k/v, gate and up colwise; o and
down rowwise (Megatron-LM's split, one all-reduce per attention and per MLP)."""


def build_llama(vocab: int, dim: int, heads: int, hidden: int, depth: int) -> nn.Sequential:
    """``[Embedding(vocab, dim), depth × LlamaBlock, RMSNorm, Linear(dim, vocab)]``: ids ``(N, T)``
    → logits ``(N, T, vocab)``; ``dim`` must be a multiple of ``heads``."""
    if dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}; choose dim = heads × head size")
    return nn.Sequential(
        nn.Embedding(vocab, dim),
        *(LlamaBlock(dim, heads, hidden) for _ in range(depth)),
        nn.RMSNorm(dim),
        nn.Linear(dim, vocab, bias=False),
    )


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
