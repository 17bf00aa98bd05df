"""Small models and data shared by the tests and the multi-process workers they launch."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Mix(nn.Module):
    """Stage-boundary tuple ``(h float, ids long, mask bool)`` → same tuple, ids and mask used."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, inputs):
        h, ids, mask = inputs
        h = torch.tanh(self.lin(h) + self.emb(ids) * mask.unsqueeze(-1))
        return h, ids, mask


class Head(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, out)

    def forward(self, inputs):
        h, _, mask = inputs
        return self.lin(h) * mask.unsqueeze(-1)


class Embed(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, dim)

    def forward(self, inputs):
        x, ids, mask = inputs
        return self.lin(x), ids, mask


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, message):
        ctx.message = message
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.message:
            raise RuntimeError(ctx.message)
        return grad, None


class FailAt(nn.Module):
    """Wraps a layer; raises on its ``at``-th forward (or backward) call, counting from 1."""

    def __init__(self, layer: nn.Module, where: str, at: int) -> None:
        super().__init__()
        self.layer, self.where, self.at, self.calls = layer, where, at, 0

    def forward(self, x):
        self.calls += 1
        if self.where == "forward" and self.calls == self.at:
            raise RuntimeError(f"injected failure in forward call {self.at}")
        y = self.layer(x)
        if self.where == "backward":
            message = f"injected failure in backward call {self.at}" if self.calls == self.at else ""
            y = _RaiseInBackward.apply(y, message)
        return y


def build_layers(kind: str) -> nn.Sequential:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "dropout":
        return nn.Sequential(
            nn.Linear(6, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 3)
        )
    if kind == "tuple":
        return nn.Sequential(Embed(8, 5), Mix(8, 5), Mix(8, 5), Head(8, 3))
    if kind == "bn":
        return nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Linear(16, 3),
        )
    if kind == "seq":
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    raise ValueError(kind)


class Net(pl.LightningModule):
    """The user's module: ``self.layers`` is pipelined; ``training_step`` is plain single-device code."""

    def __init__(
        self,
        kind: str = "mlp",
        lr: float = 0.1,
        record_grads: bool = False,
        call_twice: bool = False,
        fail: dict | None = None,
        wrong_shape: bool = False,
    ) -> None:
        super().__init__()
        self.kind, self.lr, self.record_grads, self.call_twice = kind, lr, record_grads, call_twice
        self.layers = build_layers(kind)
        if wrong_shape:  # stage 1 of 3 hands stage 2 (N, 17) where Linear(16, 3) expects (N, 16)
            self.layers[2] = nn.Linear(16, 17)
        if fail:  # {"layer": index, "where": "forward" | "backward", "at": call number}
            self.layers[fail["layer"]] = FailAt(self.layers[fail["layer"]], fail["where"], fail["at"])
        self.losses: list[float] = []
        self.shapes: list[tuple[int, ...]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        *inputs, y = batch
        out = self(inputs[0] if len(inputs) == 1 else tuple(inputs))
        if self.call_twice:
            out = out + self(inputs[0])
        loss = F.mse_loss(out, y)
        self.losses.append(loss.item())
        self.shapes.append(tuple(out.shape))
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.record_grads:
            self.grads.append(
                {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
            )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_data(kind: str, batch: int = 10, steps: int = 5, seed: int = 1):
    """A loader whose order is fixed (no shuffle), ``steps`` batches of ``batch`` samples."""
    g = torch.Generator().manual_seed(seed)
    n = batch * steps
    if kind in ("mlp", "dropout", "bn"):
        data = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))
        return DataLoader(data, batch_size=batch, shuffle=False)
    if kind == "tuple":
        x = torch.randn(n, 7, 4, generator=g)
        ids = torch.randint(0, 5, (n, 7), generator=g)
        mask = torch.rand(n, 7, generator=g) > 0.3
        y = torch.randn(n, 7, 3, generator=g)
        return DataLoader(TensorDataset(x, ids, mask, y), batch_size=batch, shuffle=False)
    if kind == "seq":
        lengths = [7, 13, 5, 9, 4][:steps]
        batches = [
            (torch.randn(batch, t, 4, generator=g), torch.randn(batch, t, 2, generator=g)) for t in lengths
        ]
        return DataLoader(batches, batch_size=None, shuffle=False)
    raise ValueError(kind)


def trainer_kwargs(steps: int) -> dict:
    return dict(
        accelerator="cpu",
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def train_single_device(
    kind: str, seed: int, steps: int = 5, batch: int = 10, lr: float = 0.1, record_grads=False
):
    """The reference: the same module under a plain one-device Trainer, full batch."""
    pl.seed_everything(seed, verbose=False)
    model = Net(kind, lr=lr, record_grads=record_grads)
    trainer = pl.Trainer(devices=1, **trainer_kwargs(steps))
    trainer.fit(model, make_data(kind, batch, steps))
    return model
