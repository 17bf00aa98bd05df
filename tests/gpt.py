"""A nanoGPT-style LightningModule pipelined by naming its parts (``GPipeStrategy(plan=PLAN)``): token and
position embedding in one part, the blocks in an ``nn.ModuleList``, a final LayerNorm, and an lm head tied to
the token embedding. Shared by the in-process tests and the multi-process worker."""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = importlib.import_module(os.environ.get("GPIPE_TEST_LIGHTNING", "pytorch_lightning"))

VOCAB, LENGTH, DIM, HEADS, DEPTH = 17, 8, 16, 2, 4
PLAN = ["embed", "blocks", "norm", "head"]


class Embed(nn.Module):
    """Token plus position embedding: ``(N, T)`` ids → ``(N, T, DIM)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(LENGTH, DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: ``(N, T, DIM)`` → ``(N, T, DIM)``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, DIM))
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """The forward is the chain ``head(norm(blocks(embed(idx))))``; the loss is next-token cross-entropy."""

    def __init__(self, lr: float = 0.2, tied: bool = True) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.tok.weight
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def gpt_data(batch: int = 8, steps: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randint(0, VOCAB, (batch * steps, LENGTH), generator=g)), batch_size=batch
    )
