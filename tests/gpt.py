"""A nanoGPT-style LightningModule pipelined by naming its parts (``GPipeStrategy(plan=PLAN)``): token and
position embedding in one part, the blocks in an ``nn.ModuleList``, a final LayerNorm, and an lm head tied to
the token embedding. Shared by the in-process tests and the multi-process worker."""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from tests import norms

pl = importlib.import_module(os.environ.get("GPIPE_TEST_LIGHTNING", "pytorch_lightning"))

VOCAB, LENGTH, DIM, HEADS, DEPTH = 17, 8, 16, 2, 4
PLAN = ["embed", "blocks", "norm", "head"]
TP_VOCAB = 16  # even: T = 2 shards the tied weight evenly


class Embed(nn.Module):
    """Token plus position embedding: ``(N, T)`` ids → ``(N, T, dim)``."""

    def __init__(self, vocab: int = VOCAB, length: int = LENGTH, dim: int = DIM) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: ``(N, T, dim)`` → ``(N, T, dim)``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """The forward is the chain ``head(norm(blocks(embed(idx))))``; the loss is next-token cross-entropy.
    ``size`` overrides the sizes (``vocab``, ``length``, ``dim``, ``heads``, ``depth``)."""

    def __init__(self, lr: float = 0.2, tied: bool = True, size: dict | None = None) -> None:
        super().__init__()
        sizes = {"vocab": VOCAB, "length": LENGTH, "dim": DIM, "heads": HEADS, "depth": DEPTH, **(size or {})}
        self.vocab, dim = sizes["vocab"], sizes["dim"]
        self.embed = Embed(sizes["vocab"], sizes["length"], dim)
        self.blocks = nn.ModuleList(Block(dim, sizes["heads"]) for _ in range(sizes["depth"]))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, sizes["vocab"], bias=False)
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
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def gpt_data(batch: int = 8, steps: int = 4, vocab: int = VOCAB, length: int = LENGTH) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randint(0, vocab, (batch * steps, length), generator=g)), batch_size=batch
    )


class TensorParallelGPT(GPT):
    """:class:`GPT` (vocabulary 16) with a tensor-parallel plan for ``GPipeStrategy(tensor_parallel_size=T)``
    (issue 42, item 4): each block's MLP colwise then rowwise; with ``tied_plan="both"`` the tied token
    embedding rowwise and the head colwise too (both shard the one weight on dimension 0, the vocabulary; the
    head's logits gathered whole), with ``"embed"`` the embedding alone, with ``"none"`` neither. Records the
    step losses, the strategy's total gradient norm (on one device: the norm before Lightning clips) and
    Lightning's ``grad_norm(self)`` total in ``on_before_optimizer_step`` (the whole model's on every rank,
    issue 40); logs the epoch's mean loss (``train_loss``)."""

    def __init__(self, tied_plan: str = "none") -> None:
        super().__init__(size={"vocab": TP_VOCAB})
        self.tied_plan = tied_plan
        self.norms: list[float] = []
        self.hook_norms: list[float] = []
        self.dtensor_names: list[str] = []  # this rank's DTensor parameters as training starts

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)  # the epoch's mean, on every rank
        return loss

    def on_train_start(self) -> None:
        self.dtensor_names = [n for n, p in self.named_parameters() if isinstance(p, DTensor)]

    def parallelize_stage(self, stage: nn.Module, tp_mesh) -> None:
        for layer in stage.children():
            if isinstance(layer, Block):
                parallelize_module(layer, tp_mesh, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
            elif self.tied_plan in ("both", "embed") and isinstance(layer, Embed):
                parallelize_module(layer, tp_mesh, {"tok": RowwiseParallel(input_layouts=Replicate())})
            elif self.tied_plan == "both" and isinstance(layer, nn.Linear):
                parallelize_module(layer, tp_mesh, ColwiseParallel(output_layouts=Replicate()))

    def on_before_optimizer_step(self, optimizer) -> None:
        norms.before_optimizer_step(self)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        norms.after_batch(self)
