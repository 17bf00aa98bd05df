"""Small models and data shared by the tests and the multi-process workers they launch."""

from __future__ import annotations

import importlib
import os
import time

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.engine.microbatch import no_chunk
from lightning_gpipe.engine.skip import Pop, Stash

# The Lightning namespace the models and Trainers come from: "pytorch_lightning" (default) or
# "lightning.pytorch" (``import lightning as L``); workers set it from their spec.
LIGHTNING = os.environ.get("GPIPE_TEST_LIGHTNING", "pytorch_lightning")
pl = importlib.import_module(LIGHTNING)


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


def pytree_input(x, mask):
    """The pytree model's input: ``{"h": (N, T, d), "mask": bool (N, T), "causal": bool (T, T),
    "rope": (cos, sin) each (T, d), "scale": 0.5, "note": None}`` (N = 10, T = 7: h and mask split,
    the rest replicated)."""
    t, d = x.shape[1], x.shape[2]
    angle = torch.arange(t, dtype=x.dtype).unsqueeze(-1) * torch.linspace(0.1, 1.0, d, dtype=x.dtype)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return {
        "h": x,
        "mask": mask,
        "causal": causal,
        "rope": (angle.cos(), angle.sin()),
        "scale": 0.5,
        "note": None,
    }


class RopeGain(nn.Module):
    """Scales the rotary tables by a learned gain: replicated tensors that require grad, kept whole."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, inputs):
        cos, sin = inputs["rope"]
        return {**inputs, "rope": (no_chunk(cos * self.gain), no_chunk(sin * self.gain))}


class RopeBlock(nn.Module):
    """The pytree model's dict → the same dict with ``h`` updated from every other entry."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, inputs):
        assert inputs["note"] is None and isinstance(inputs["scale"], float)
        h, mask, causal = inputs["h"], inputs["mask"], inputs["causal"]
        cos, sin = inputs["rope"]
        rotated = h * cos + torch.roll(h, 1, dims=-1) * sin
        mixed = causal.to(h.dtype) @ rotated / causal.sum(-1, keepdim=True)  # (T, T) @ (N, T, d)
        return {**inputs, "h": h + torch.tanh(self.lin(mixed)) * inputs["scale"] * mask.unsqueeze(-1)}


class DictHead(nn.Module):
    """The pytree model's last layer: ``{"y": (N, T, out), "rope": the tables, "scale", "note"}``."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, out)

    def forward(self, inputs):
        y = self.lin(inputs["h"]) * inputs["mask"].unsqueeze(-1)
        return {"y": y, "rope": inputs["rope"], "scale": inputs["scale"], "note": inputs["note"]}


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


class _NanInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


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
        if self.where == "nan_backward" and self.calls == self.at:
            y = _NanInBackward.apply(y)
        return y


class Slow(nn.Module):
    """Wraps a layer; sleeps ``seconds`` before each forward call (a stage that lags behind)."""

    def __init__(self, layer: nn.Module, seconds: float) -> None:
        super().__init__()
        self.layer, self.seconds = layer, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.layer(x)


class Counter(nn.Module):
    """Identity that counts in training: a persistent buffer, an int attribute and a list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.calls, self.sizes = 0, []

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
            self.calls += 1
            self.sizes.append(x.shape[0])
        return x

    def effects(self) -> dict:
        return {"calls": self.calls, "sizes": list(self.sizes)}


class EmaCenter(nn.Module):
    """``x - mean``, then (training) ``mean`` moves halfway to the batch mean: the output depends on
    the buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))

    def forward(self, x):
        y = x - self.mean
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return y


class SpectralLinear(nn.Module):
    """A spectral-normed Linear (power iteration updates buffers in place) and a forward hook that counts."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(dim, dim))
        self.hook_calls = 0
        self.register_forward_hook(SpectralLinear._count)

    @staticmethod
    def _count(module, args, output):
        module.hook_calls += 1

    def forward(self, x):
        return self.lin(x)

    def effects(self) -> dict:
        return {"hook_calls": self.hook_calls}


class MetricTap(nn.Module):
    """Dropout whose input's mean a torchmetrics metric tracks in training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)
        self.metric = torchmetrics.MeanMetric()

    def forward(self, x):
        if self.training:
            self.metric.update(x.detach().mean())
        return self.drop(x)

    def effects(self) -> dict:
        return {
            "updates": self.metric._update_count,
            "sum": self.metric.mean_value.item(),
            "n": self.metric.weight.item(),
        }


class Concat(nn.Module):
    def forward(self, x, skip):
        return torch.cat([x, skip], dim=-1)


def build_layers(kind: str) -> nn.Sequential:
    if kind in ("mlp", "cls"):
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "dropout":
        return nn.Sequential(
            nn.Linear(6, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 3)
        )
    if kind == "tuple":
        return nn.Sequential(Embed(8, 5), Mix(8, 5), Mix(8, 5), Head(8, 3))
    if kind == "pytree":  # a dict with split, replicated and non-tensor leaves between stages
        return nn.Sequential(RopeGain(8), *(RopeBlock(8) for _ in range(4)), DictHead(8, 3))
    if kind == "lrl":  # over 3 stages: [Linear], [ReLU] (no parameters), [Linear]
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if kind == "unet":  # over 3 stages (balance [2, 2, 2]) stage 0 hands "enc" to stage 2, never to stage 1
        return nn.Sequential(
            Stash("enc", nn.Linear(6, 8)),
            nn.Tanh(),
            nn.Linear(8, 8),
            nn.Tanh(),
            Pop("enc", Concat()),
            nn.Linear(16, 3),
        )
    if kind == "effects":  # forwards that change more than their output; balance [3, 4]
        return nn.Sequential(
            nn.Linear(6, 16),
            Counter(),
            SpectralLinear(16),
            EmaCenter(16),
            MetricTap(0.2),
            nn.Tanh(),
            nn.Linear(16, 3),
        )
    if kind == "ids":  # the first stage receives token ids only
        return nn.Sequential(nn.Embedding(11, 8), nn.Tanh(), nn.Linear(8, 3))
    if kind == "tied":  # the embedding (stage 0) is the head's weight (last stage): tied across stages
        embedding, head = nn.Embedding(11, 8), nn.Linear(8, 11, bias=False)
        head.weight = embedding.weight
        return nn.Sequential(embedding, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), head)
    if kind == "cbr":  # Conv-BN-ReLU, one layer per stage over 3 stages
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    if kind == "bn":
        return nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Linear(16, 3),
        )
    if kind == "ln":  # balance [4, 2]: stage 1 starts with the LayerNorm
        return nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3)
        )
    if kind == "seq":
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    raise ValueError(kind)


class Net(pl.LightningModule):
    """The user's module: ``self.layers`` is pipelined; the steps are plain single-device code.

    Options record what the tests compare (losses, gradients, clipped gradients, norms, sample
    indices) or inject faults.
    """

    def __init__(
        self,
        kind: str = "mlp",
        lr: float = 0.1,
        record_grads: bool = False,
        call_twice: bool = False,
        fail: dict | None = None,
        slow: dict | None = None,
        wrong_shape: bool = False,
        indexed: bool = False,
        sync_dist: bool = False,
        ref_clip_norm_type: float | None = None,
        freeze_first: bool = False,
        freeze: list[int] | None = None,
        scheduler: bool = False,
        two_optimizers: bool = False,
        log_first: bool = False,
        record_params: bool = False,
        pretrained_seed: int | None = None,
        plateau: bool = False,
        stop_at: int | None = None,
        groups: str | None = None,
        compile_layers: dict | None = None,
        stale_forward: bool = False,
        iterate_layers: bool = False,
        val_stop_at: list[int] | None = None,
        draw_after_call: bool = False,
        draw_before_call: bool = False,
    ) -> None:
        super().__init__()
        self.kind, self.lr, self.record_grads, self.call_twice = kind, lr, record_grads, call_twice
        self.indexed, self.sync_dist, self.ref_clip_norm_type = indexed, sync_dist, ref_clip_norm_type
        self.scheduler, self.two_optimizers, self.log_first = scheduler, two_optimizers, log_first
        self.lrs: list[float] = []
        self.record_params = record_params
        self.params: list[dict[str, torch.Tensor]] = []  # after every step, with record_params
        self.plateau, self.stop_at, self.groups = plateau, stop_at, groups
        self.val_stop_at = val_stop_at  # [global_step, val batch_idx]: should_stop set in validation_step
        # the step draws from torch's generator after the pipelined call, and before it (a random mask
        # every stage must agree on)
        self.draw_after_call, self.draw_before_call = draw_after_call, draw_before_call
        self.pre_draws: list[list[float]] = []
        self.step_lrs: list[float] = []  # the learning rate each step uses
        self.layers = build_layers(kind)
        if wrong_shape:  # stage 1 of 3 hands stage 2 (N, 17) where Linear(16, 3) expects (N, 16)
            self.layers[2] = nn.Linear(16, 17)
        if fail:  # {"layer": index, "where": "forward" | "backward", "at": call number}
            self.layers[fail["layer"]] = FailAt(self.layers[fail["layer"]], fail["where"], fail["at"])
        if slow:  # {"layer": index, "seconds": sleep per forward call}
            self.layers[slow["layer"]] = Slow(self.layers[slow["layer"]], slow["seconds"])
        if pretrained_seed is not None and os.environ.get("LOCAL_RANK", "0") == "0":
            # "pretrained" weights loaded on local rank 0 only (the random draws leave no trace)
            with torch.random.fork_rng():
                torch.manual_seed(pretrained_seed)
                self.layers.load_state_dict(build_layers(kind).state_dict())
        if freeze_first:
            self.layers[0].requires_grad_(False)
        for k in freeze or ():  # layers k frozen (e.g. every layer of a middle stage)
            self.layers[k].requires_grad_(False)
        self.iterate_layers = iterate_layers  # `for layer in self.layers:` inside the step
        # a reference to the Sequential's forward kept from __init__: calls the whole original Sequential
        self._stale_forward = self.layers.forward if stale_forward else None
        if compile_layers is not None:  # the user's torch.compile of the pipelined Sequential
            self.layers = torch.compile(self.layers, **compile_layers)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.losses: list[float] = []
        self.synced_losses: list[float] = []
        self.shapes: list[tuple[int, ...]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.clipped: list[dict[str, torch.Tensor]] = []
        self.norms: list[float] = []
        self.indices: list[list[int]] = []

    def forward(self, x):
        if self.kind == "pytree":
            x = pytree_input(*x)
        if self.iterate_layers:
            for layer in self.layers:
                x = layer(x)
            return x
        if self._stale_forward is not None:
            return self._stale_forward(x)
        return self.layers(x)

    def _loss(self, out, y):
        if self.kind == "pytree":  # the replicated tables reach the loss too
            return F.mse_loss(out["y"], y) + 0.1 * out["rope"][0].square().mean()
        return F.cross_entropy(out, y) if self.kind == "cls" else F.mse_loss(out, y)

    def training_step(self, batch, batch_idx):
        if self.indexed:
            *batch, idx = batch
            self.indices.append(idx.tolist())
        *inputs, y = batch
        if self.draw_before_call:
            self.pre_draws.append(torch.rand(2).tolist())
        if self.log_first:  # logging before the pipelined call
            self.log("batch_size", float(len(y)))
        out = self(inputs[0] if len(inputs) == 1 else tuple(inputs))
        if self.call_twice:
            out = out + self(inputs[0])
        loss = self._loss(out, y)
        if self.draw_after_call:  # e.g. a sampled loss: drawn on the last stage only
            loss = loss + 0.0 * torch.rand(3).sum()
        self.losses.append(loss.item())
        self.shapes.append(tuple((out["y"] if self.kind == "pytree" else out).shape))
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        if batch_idx == self.stop_at:  # decided after the pipelined call: on the last stage only
            self.trainer.should_stop = True
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.step_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_start(self):
        executor = getattr(self.layers, "executor", None)  # a PipelineStage's: its compiled layers
        self.stage_compiled = executor is not None and executor.compiled is not None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.record_params:
            self.params.append({n: p.detach().clone() for n, p in self.named_parameters()})
        if "train_loss" in self.trainer.callback_metrics:
            self.synced_losses.append(self.trainer.callback_metrics["train_loss"].item())

    def validation_step(self, batch, batch_idx):
        if self.indexed:
            *batch, _ = batch
        *inputs, y = batch
        out = self(inputs[0] if len(inputs) == 1 else tuple(inputs))
        loss = self._loss(out, y)
        self.log("val_loss", loss, sync_dist=self.sync_dist)
        if self.val_stop_at is not None and [self.trainer.global_step, batch_idx] == list(self.val_stop_at):
            # decided after the pipelined call, with the loss in hand: on the last stage only
            if torch.isfinite(loss):
                self.trainer.should_stop = True
        if self.kind == "cls":
            self.acc(out, y)
            self.log("val_acc", self.acc)

    def predict_step(self, batch, batch_idx):
        *inputs, _ = batch
        return self(inputs[0] if len(inputs) == 1 else tuple(inputs))

    def on_before_optimizer_step(self, optimizer):
        if self.record_grads:
            self.grads.append(
                {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
            )

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.ref_clip_norm_type is not None:  # one-device reference: torch's own clipping, any norm
            norm = torch.nn.utils.clip_grad_norm_(
                self.parameters(), gradient_clip_val, self.ref_clip_norm_type
            )
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            norm = getattr(self.trainer.strategy, "last_grad_norm", None)
        if norm is not None:
            self.norms.append(float(norm))
        self.clipped.append(
            {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
        )

    def configure_optimizers(self):
        if self.groups == "frozen":  # the usual idiom with frozen layers
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)
        if self.groups == "head":  # one-device code naming layers: the head's group is empty on other stages
            return torch.optim.AdamW(
                [
                    {"params": self.layers[-1].parameters(), "lr": 0.05},
                    {"params": self.layers[:-1].parameters()},
                ],
                lr=0.01,
            )
        if self.groups is not None:
            # AdamW with decay / no-decay groups in the order they first occur in named_parameters();
            # "bias_norm": biases and norms not decayed; "norm": norms only
            def no_decay(name: str) -> bool:
                return name.startswith("layers.4.") or (self.groups == "bias_norm" and name.endswith("bias"))

            made: dict[bool, list] = {}
            for name, p in self.named_parameters():
                if p.requires_grad:
                    made.setdefault(no_decay(name), []).append(p)
            return torch.optim.AdamW(
                [{"params": ps, "weight_decay": 0.0 if nd else 0.1} for nd, ps in made.items()], lr=0.01
            )
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.two_optimizers:
            return [optimizer, torch.optim.SGD(self.parameters(), lr=self.lr)]
        if self.plateau:  # halves the learning rate after every step (threshold 10: never an improvement)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                optimizer, "min", factor=0.5, patience=0, threshold=10
            )
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"},
            }
        if self.scheduler:
            return {
                "optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
            }
        return optimizer

    def on_train_epoch_end(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def make_data(
    kind: str,
    batch: int = 10,
    steps: int = 5,
    seed: int = 1,
    indexed: bool = False,
    samples: int | None = None,
    order: list[list[int]] | None = None,
    shuffle: bool = False,
):
    """A loader of ``steps`` batches of ``batch`` samples, in a fixed order unless ``shuffle``.

    ``indexed`` appends each sample's index to the batch; ``samples`` sets the dataset size
    (default ``batch × steps``); ``order`` gives the sample indices of each batch explicitly.
    """
    g = torch.Generator().manual_seed(seed)
    n = samples or batch * steps
    extra = (torch.arange(n),) if indexed else ()
    if kind in ("mlp", "dropout", "bn", "lrl", "cls", "unet", "effects", "ln"):
        x = torch.randn(n, 6, generator=g)
        y = torch.randint(0, 3, (n,), generator=g) if kind == "cls" else torch.randn(n, 3, generator=g)
        data = TensorDataset(x, y, *extra)
        if order is not None:
            return DataLoader([data[idx] for idx in order], batch_size=None, shuffle=False)
        return DataLoader(data, batch_size=batch, shuffle=shuffle)
    if kind in ("ids", "tied"):
        width = 3 if kind == "ids" else 11
        data = TensorDataset(
            torch.randint(0, 11, (n, 5), generator=g), torch.randn(n, 5, width, generator=g), *extra
        )
        return DataLoader(data, batch_size=batch, shuffle=False)
    if kind == "cbr":
        data = TensorDataset(
            torch.randn(n, 3, 5, 5, generator=g), torch.randn(n, 4, 5, 5, generator=g), *extra
        )
        return DataLoader(data, batch_size=batch, shuffle=False)
    if kind == "pytree":
        x = torch.randn(n, 7, 8, generator=g)
        mask = torch.rand(n, 7, generator=g) > 0.3
        return DataLoader(TensorDataset(x, mask, torch.randn(n, 7, 3, generator=g)), batch_size=batch)
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
    kind: str,
    seed: int,
    steps: int = 5,
    batch: int = 10,
    lr: float = 0.1,
    trainer_extra: dict | None = None,
    val: bool = False,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    return_trainer: bool = False,
    data: dict | None = None,
    **net_kwargs,
):
    """The reference: the same module under a plain one-device Trainer, full batch."""
    pl.seed_everything(seed, verbose=False)
    model = Net(kind, lr=lr, **net_kwargs)
    trainer = pl.Trainer(
        devices=1, callbacks=list(callbacks), **{**trainer_kwargs(steps), **(trainer_extra or {})}
    )
    indexed = net_kwargs.get("indexed", False)
    val_loader = make_data(kind, batch, 2, seed=2, indexed=indexed) if val else None
    train_loader = make_data(kind, batch, max(steps, 5), indexed=indexed, **(data or {}))
    trainer.fit(model, train_loader, val_loader, ckpt_path=ckpt_path)
    return (model, trainer) if return_trainer else model


def alternate(make_trainer, rounds: int):
    """val, val, train one step, val — ``rounds`` times, each with a fresh Trainer from ``make_trainer``.

    Returns the module and the validation losses in order.
    """
    pl.seed_everything(0, verbose=False)
    model = Net("mlp")  # no BatchNorm: micro-batch statistics would differ from the full batch's
    train, val = make_data("mlp", 10, 5), make_data("mlp", 10, 2, seed=2)
    quiet = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    losses = []
    for _ in range(rounds):
        for phase in ("val", "val", "train", "val"):
            if phase == "train":
                make_trainer(max_steps=1, enable_checkpointing=False, num_sanity_val_steps=0, **quiet).fit(
                    model, train
                )
            else:
                result = make_trainer(**quiet).validate(model, val, verbose=False)
                losses.append(result[0]["val_loss"] if result and result[0] else None)
    return model, losses


class Recorder(pl.loggers.Logger):
    """A logger that keeps every ``log_metrics`` call in memory (``self.logged``)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class StopProbe(pl.Callback):
    """Records ``(global_step, batch_idx, trainer.should_stop)`` in ``on_validation_batch_end`` (``seen``)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append((trainer.global_step, batch_idx, bool(trainer.should_stop)))


class Writer(pl.callbacks.BasePredictionWriter):
    """Keeps what it is asked to write: ``batches`` (per batch) and ``epoch`` (all predictions)."""

    def __init__(self, write_interval: str = "batch_and_epoch") -> None:
        super().__init__(write_interval)
        self.batches: list[torch.Tensor] = []
        self.epoch: list = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        self.batches.append(prediction.clone())

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch.append(torch.cat(predictions))


def feature_callbacks(names: dict) -> list:
    """Lightning callbacks by name, from the test namespace: ``{"swa": kwargs, "ema": kwargs,
    "throughput": kwargs, "summary": kwargs, "writer": kwargs,
    "pruning": kwargs (ModelPruning("l1_unstructured")),
    "lr_monitor": kwargs, "accumulation": {"scheduling": {epoch (str or int): factor}},
    "stop_probe": {} (:class:`StopProbe`)}``."""
    made = {
        "swa": lambda kw: pl.callbacks.StochasticWeightAveraging(**kw),
        "ema": lambda kw: pl.callbacks.EMAWeightAveraging(**kw),
        "throughput": lambda kw: pl.callbacks.ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0), **kw),
        "summary": lambda kw: pl.callbacks.ModelSummary(**kw),
        "writer": lambda kw: Writer(**kw),
        "stop_probe": lambda kw: StopProbe(**kw),
        "pruning": lambda kw: pl.callbacks.ModelPruning("l1_unstructured", **kw),
        "lr_monitor": lambda kw: pl.callbacks.LearningRateMonitor(**kw),
        "accumulation": lambda kw: pl.callbacks.GradientAccumulationScheduler(
            {int(epoch): factor for epoch, factor in kw["scheduling"].items()}
        ),
    }
    return [made[name](kw) for name, kw in names.items()]


def build_lazy_layers(kind: str, size: dict | None = None) -> nn.Sequential:
    """Layers of :class:`LazyNet`: ``"mlp"`` (as :class:`Net`'s), a decoder-only ``"transformer"``, or
    ``"llama"``: :func:`~lightning_gpipe.integrations.transformers.causal_lm` of a transformers
    ``LlamaForCausalLM(LlamaConfig(**size))`` (``size["seq_len"]`` sizes the data only)."""
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from lightning_gpipe.integrations.transformers import causal_lm

        config = {k: v for k, v in (size or {}).items() if k != "seq_len"}
        return causal_lm(LlamaForCausalLM(LlamaConfig(**config)))
    if kind == "transformer":  # size["tied"]: the LM head's weight is the token embedding's (GPT-2's tie)
        from recipes.models.transformer import build_transformer

        sizes = dict(size or {})
        tied = sizes.pop("tied", False)
        layers = build_transformer(**sizes)
        if tied:
            layers[-1].weight = layers[0].tokens.weight
        return layers
    return build_layers(kind)


class LazyNet(pl.LightningModule):
    """A module for the large-model path: its Sequential is built in ``configure_model`` (``deferred``) or in
    ``__init__``; Adam (or SGD with momentum); records its losses (last stage).
    """

    def __init__(
        self,
        kind: str = "mlp",
        lr: float = 0.01,
        deferred: bool = True,
        size: dict | None = None,
        optimizer: str = "adam",
    ):
        super().__init__()
        self.save_hyperparameters()
        self.kind, self.lr, self.size, self.optimizer = kind, lr, size, optimizer
        self.layers = None if deferred else build_lazy_layers(kind, size)
        self.whole = [self.layers]  # the whole Sequential, kept (not as a submodule) for the tests to inspect
        self.losses: list[float] = []

    def configure_model(self):
        if self.layers is None:
            self.layers = build_lazy_layers(self.kind, self.size)
            self.whole = [self.layers]

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.kind in ("transformer", "llama"):
            loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        else:
            loss = F.mse_loss(out, y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class OddStepNet(LazyNet):
    """:class:`LazyNet` whose ``training_step`` returns ``None`` at global step ``none_at`` (Lightning refuses
    it on more than one process) or its loss times NaN at global step ``nan_at``."""

    def __init__(self, *args, none_at: int | None = None, nan_at: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.none_at, self.nan_at = none_at, nan_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.none_at:
            return None
        return loss * float("nan") if self.trainer.global_step == self.nan_at else loss


def make_lazy_data(kind: str, batch: int, steps: int, size: dict | None = None, seed: int = 1):
    """Data for :class:`LazyNet`: ``make_data("mlp")``, or random token ids (inputs, next tokens)."""
    if kind not in ("transformer", "llama"):
        return make_data(kind, batch, steps, seed=seed)
    size = size or {}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        0, size.get("vocab_size", 256), (batch * steps, size.get("seq_len", 64) + 1), generator=g
    )
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch, shuffle=False)
