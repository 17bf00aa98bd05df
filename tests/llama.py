"""A Llama-style LightningModule for tensor parallelism (issue 42, item 3): RMSNorm, causal attention with
q/k/v/o projections and a SwiGLU MLP per block, in one ``nn.Sequential``. ``parallelize_stage`` applies
the standard plan to each block of a stage (q/k/v and the MLP's gate/up colwise, o and down rowwise); an
``Up``/``Down`` pair after the blocks keeps its sharded activation as a ``DTensor``
(``use_local_output=False``), so that a cut between them sends a ``DTensor`` from one stage to the next.
Shared by the tests and the worker.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from tests import norms

pl = importlib.import_module(os.environ.get("GPIPE_TEST_LIGHTNING", "pytorch_lightning"))

VOCAB, LENGTH, DIM, HEADS, HIDDEN = 23, 8, 16, 4, 32

BLOCK_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``1 + 0.1·N(0, 1)`` per element (also what stage-only materialization calls)."""
        with torch.no_grad():
            self.weight.copy_(1 + 0.1 * torch.randn(self.weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        hd = DIM // HEADS  # heads per rank: all of them on one device, HEADS / T under tensor parallelism
        q, k, v = (p(x).view(n, t, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(DIM), Attention()
        self.mlp_norm, self.mlp = RMSNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Up(nn.Linear):
    """Colwise under tensor parallelism, its output left a ``DTensor`` (``Shard(-1)``)."""


class Down(nn.Linear):
    """Rowwise under tensor parallelism: takes the ``Shard(-1)`` DTensor, returns a plain tensor."""


class Llama(pl.LightningModule):
    """``[embedding, block, block, Up, SiLU, Down, RMSNorm, head]``; next-token cross-entropy, Adam; the
    validation loss recorded per batch.

    Records on the last stage the step losses and the strategy's total gradient norm before clipping;
    on one device the total norm of the gradients before Lightning clips them; on every rank the total
    ``grad_norm(self)`` gives in ``on_before_optimizer_step`` (``hook_norms``).
    """

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Embedding(VOCAB, DIM), Block(), Block(), Up(DIM, HIDDEN), nn.SiLU(), Down(HIDDEN, DIM),
            RMSNorm(DIM), nn.Linear(DIM, VOCAB),
        )  # fmt: skip
        self.lr = lr
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.hook_norms: list[
            float
        ] = []  # Lightning's grad_norm(self) total: the whole model's on every rank
        self.dtensor_parameters = 0  # on this rank's stage, as training starts
        self.dtensor_mesh_dims = 0  # the most mesh dimensions of one of them (2: FSDP × TP)
        self.dtensor_outputs = 0  # calls of the Sequential in training_step that returned a DTensor
        self.val_losses: list[float] = []  # validation_step's, on the last stage

    def parallelize_stage(self, stage: nn.Module, tp_mesh) -> None:
        for layer in stage.children():
            if isinstance(layer, Block):
                parallelize_module(layer, tp_mesh, BLOCK_PLAN)
            elif isinstance(layer, Up):
                parallelize_module(layer, tp_mesh, ColwiseParallel(use_local_output=False))
            elif isinstance(layer, Down):
                parallelize_module(layer, tp_mesh, RowwiseParallel())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(ids)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.val_losses.append(loss.item())

    def on_train_start(self) -> None:
        dtensors = [p for p in self.parameters() if isinstance(p, DTensor)]
        self.dtensor_parameters = len(dtensors)
        self.dtensor_mesh_dims = max((p.device_mesh.ndim for p in dtensors), default=0)

    def on_before_optimizer_step(self, optimizer) -> None:
        norms.before_optimizer_step(self)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        norms.after_batch(self)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class OddStepLlama(Llama):
    """:class:`Llama` whose ``training_step`` returns ``None`` at global step ``none_at`` (Lightning refuses
    it on more than one process) or its loss times NaN at global step ``nan_at``."""

    def __init__(self, none_at: int | None = None, nan_at: int | None = None) -> None:
        super().__init__()
        self.none_at, self.nan_at = none_at, nan_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.none_at:
            return None
        return loss * float("nan") if self.trainer.global_step == self.nan_at else loss


class ShardedLogits(Llama):
    """The head colwise too, its logits left a ``Shard(-1)`` DTensor: the last stage's output is a DTensor,
    and the loss is taken over the sharded logits under ``loss_parallel``, its backward too (as
    ``loss_parallel`` requires)."""

    def parallelize_stage(self, stage: nn.Module, tp_mesh) -> None:
        super().parallelize_stage(stage, tp_mesh)
        for layer in stage.children():
            if isinstance(layer, nn.Linear) and layer.out_features == VOCAB:
                parallelize_module(layer, tp_mesh, ColwiseParallel(use_local_output=False))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids)
        self.dtensor_outputs += isinstance(logits, DTensor)
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
        return loss

    def backward(self, loss, *args, **kwargs) -> None:
        with loss_parallel():
            loss.backward(*args, **kwargs)


def llama_data(
    batch: int = 8, steps: int = 4, order: list[int] | None = None, samples: int | None = None
) -> DataLoader:
    """``samples`` (default ``batch × steps``) random sequences of ``LENGTH`` token ids (seeded), in
    ``order`` (indices, repeats allowed) when given."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (samples or batch * steps, LENGTH), generator=g)
    if order is not None:
        ids = ids[order]
    return DataLoader(TensorDataset(ids), batch_size=batch)
