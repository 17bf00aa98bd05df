"""Decoder-only Transformer language model as one flat ``nn.Sequential``.

The layout follows GPT-style pre-norm decoders (Radford et al., 2019) and the
Transformer-L family that GPipe scales (Huang et al., 2019, arXiv 1811.06965: ``d_model``
= 2048, ``d_ff`` = 8192, 32 heads, L layers). Every element of the Sequential is one
layer, so a pipeline can cut between any two of them:

====================  ===========================  ===============================
element               input                        output
====================  ===========================  ===============================
0 ``TokenEmbedding``  ``(N, T)`` int64 token ids   ``(N, T, d_model)`` float
1..L ``Block``        ``(N, T, d_model)``          ``(N, T, d_model)``
L+1 ``LayerNorm``     ``(N, T, d_model)``          ``(N, T, d_model)``
L+2 ``Linear`` head   ``(N, T, d_model)``          ``(N, T, vocab_size)`` logits
====================  ===========================  ===============================

The embedding and the head are not tied: in a pipeline they live on different stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Block", "CausalSelfAttention", "TokenEmbedding", "build_transformer"]


class TokenEmbedding(nn.Module):
    """Token embedding plus learned absolute positions.

    Args:
        vocab_size (int): number of token ids.
        d_model (int): width of the model.
        seq_len (int): the longest sequence the positions cover.
        dropout (float): dropout on the summed embedding.

    Shapes:
        input: ``(N, T)`` int64 token ids with ``T <= seq_len`` → ``(N, T, d_model)``.
    """

    def __init__(self, vocab_size: int, d_model: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        """Embed token ids.

        Raises:
            ValueError: if the sequence is longer than ``seq_len``.
        """
        length = ids.shape[1]
        if length > self.seq_len:
            raise ValueError(
                f"sequence longer than the positional table (length: {length}, seq_len: {self.seq_len})"
            )
        positions = torch.arange(length, device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al., 2017) on
    ``F.scaled_dot_product_attention(is_causal=True)``.

    Args:
        d_model (int): width of the model; must be divisible by ``num_heads``.
        num_heads (int): number of attention heads.
        dropout (float): dropout on the attention weights while training.

    Shapes:
        input: ``(N, T, d_model)`` → ``(N, T, d_model)``; position ``t`` sees positions ``<= t`` only.

    Raises:
        ValueError: if ``d_model`` is not divisible by ``num_heads``.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model must be divisible by num_heads (d_model: {d_model}, num_heads: {num_heads})"
            )
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    """Pre-norm Transformer decoder block (Xiong et al., 2020, arXiv 2002.04745).

    ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))`` with a GELU MLP of width ``d_ff``.

    Args:
        d_model (int): width of the model.
        num_heads (int): number of attention heads.
        d_ff (int): hidden width of the MLP.
        dropout (float): dropout on both residual branches and the attention weights.

    Shapes:
        input: ``(N, T, d_model)`` → ``(N, T, d_model)``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


def _init_weights(module: nn.Module) -> None:
    # GPT-2 style: N(0, 0.02) for projections and embeddings, zero biases; LayerNorm stays (1, 0).
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def build_transformer(
    vocab_size: int = 256,
    num_layers: int = 4,
    d_model: int = 128,
    num_heads: int = 4,
    d_ff: int = 512,
    seq_len: int = 64,
    dropout: float = 0.0,
) -> nn.Sequential:
    """Build a decoder-only language model as ``num_layers + 3`` sequential layers.

    The defaults (256 byte vocabulary, 4 layers, ``d_model`` 128, 4 heads, ``d_ff`` 512,
    context 64 bytes; 0.87 M parameters) train to well below the unigram entropy of a byte
    corpus in a few CPU minutes. GPipe's Transformer-L (arXiv 1811.06965) is
    ``build_transformer(32000, L, 2048, 32, 8192, seq_len, 0.1)``.

    Args:
        vocab_size (int): number of token ids (default: 256, bytes).
        num_layers (int): number of decoder blocks, each its own Sequential element (default: 4).
        d_model (int): model width (default: 128).
        num_heads (int): attention heads; must divide ``d_model`` (default: 4).
        d_ff (int): hidden width of each block's MLP (default: 512).
        seq_len (int): longest context in tokens, size of the position table (default: 64).
        dropout (float): dropout probability (default: 0.0).

    Returns:
        nn.Sequential: ``[TokenEmbedding, Block × num_layers, LayerNorm, Linear]`` mapping
        ``(N, T)`` int64 ids to ``(N, T, vocab_size)`` float logits, where logits at position
        ``t`` depend on ids ``0..t`` only.

    Raises:
        ValueError: if a size is not positive or ``d_model`` is not divisible by ``num_heads``.
    """
    sizes = {
        "vocab_size": vocab_size,
        "num_layers": num_layers,
        "d_model": d_model,
        "num_heads": num_heads,
        "d_ff": d_ff,
        "seq_len": seq_len,
    }
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        raise ValueError(f"transformer sizes must be positive ({bad})")
    layers: list[nn.Module] = [TokenEmbedding(vocab_size, d_model, seq_len, dropout)]
    layers += [Block(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)]
    layers += [nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)]
    model = nn.Sequential(*layers)
    model.apply(_init_weights)
    return model
