"""Everyday user code whose step outputs, logged metrics and token-count losses must look as on one device.

Each module records what its hooks see; :func:`train` runs one case on one device (``strategy=None``)
or under ``GPipeStrategy`` (tests/workers/user_code.py, every rank), and returns the record.

- ``"outputs"``: an MLP whose ``training_step`` returns ``{"loss", "preds", "n", "stats": {"mean",
  "rows"}}``, read in ``on_train_batch_end``; a torchmetrics ``MeanAbsoluteError`` logged with
  ``on_step`` and ``on_epoch``, and the value an ``R2Score``'s forward returns; ``validation_step`` /
  ``test_step`` return ``{"preds", "target"}``, gathered by a callback in ``on_validation_batch_end``
  / ``on_test_batch_end``; fit, validate, test.
- ``"epoch"``: epoch-end metrics (issue 40, kind D): a ``MeanSquaredError`` updated in
  ``training_step`` and computed, logged and reset in ``on_train_epoch_end`` (also logged doubled
  with ``on_epoch=True``), monitored there by ``EarlyStopping`` and by a ``ReduceLROnPlateau``
  scheduler; a ``MetricCollection`` (MAE, a ``BinaryAUROC`` whose ``compute()`` of no samples raises)
  computed in ``on_validation_epoch_end`` and monitored by ``ModelCheckpoint``; Lightning 2's
  migration-guide pattern, step losses appended to ``training_step_outputs`` /
  ``validation_step_outputs`` and their ``torch.stack(...).mean()`` logged in the epoch-end hooks
  (which raise on a stage where the lists stay empty); fit over up to 5 epochs with validation each
  epoch.
- ``"batchnorm"``: an MLP with two ``BatchNorm1d`` (issue 40, kind E) trained on batches of 12 under
  the default chunks (with ``batch_norm="micro_batch"``); its one-device reference (``strategy=None``)
  applies the Sequential to each 2-sample slice of the batch in turn, GPipe's per-micro-batch statistics.
- ``"tokens"``: an embedding LM with padded labels (``ignore_index=-100``, 1 to 10 valid tokens per
  sequence) whose ``training_step`` returns ``{"loss": token mean, "num_items": valid tokens}`` and
  logs ``train_loss``.
- ``"whole"``: code that means the whole model (issue 40, kind A): ``grad_norm(self)`` (2 and inf) logged
  in ``on_before_optimizer_step``, a hand ``clip_grad_norm_(self.parameters(), 0.5)`` there, the
  parameter count in ``on_after_backward``, aux losses declared with ``aux_loss`` by a layer on each
  stage, their value read with ``take_aux_losses`` in ``on_train_batch_end``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import torchmetrics
from pytorch_lightning.utilities import grad_norm
from torch import nn
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpipe import aux_loss, take_aux_losses
from tests.models import pl

EarlyStopping, ModelCheckpoint = pl.callbacks.EarlyStopping, pl.callbacks.ModelCheckpoint

VOCAB = 30


class Outputs(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )
        self.mae = torchmetrics.MeanAbsoluteError()
        self.r2 = torchmetrics.R2Score()  # logged as the value its forward returns: not a mean over samples
        self.seen: list[dict] = []
        self.mae_steps: list[float | None] = []
        self.r2_steps: list[float] = []
        self.mae_epoch: float | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layers(x)
        self.mae(out, y)
        self.log("train_mae", self.mae, on_step=True, on_epoch=True)
        self.log("train_r2", self.r2(out.flatten(), y.flatten()))
        rows = out.detach().flatten().tolist()
        stats = {"mean": float(out.detach().mean()), "rows": rows, "count": torch.tensor(x.shape[0])}
        return {"loss": F.mse_loss(out, y), "preds": out.detach(), "n": x.shape[0], "stats": stats}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        stats = outputs["stats"]
        self.seen.append(
            {
                "keys": sorted(outputs),
                "loss": float(outputs["loss"]),
                "preds": outputs["preds"].flatten().tolist(),
                "n": outputs["n"],
                "mean": stats["mean"],
                "rows": stats["rows"],
                "count": int(stats["count"]),
            }
        )
        value = self.trainer.callback_metrics.get("train_mae_step")
        self.mae_steps.append(None if value is None else float(value))
        self.r2_steps.append(float(self.trainer.callback_metrics["train_r2"]))

    def on_train_epoch_end(self):
        value = self.trainer.callback_metrics.get("train_mae_epoch")
        self.mae_epoch = None if value is None else float(value)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.layers(x)
        self.log("val_loss", F.mse_loss(out, y))
        return {"preds": out, "target": y}

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Gather(pl.Callback):
    """Collects ``outputs["preds"]`` in the evaluation hooks, as a confusion-matrix callback would."""

    def __init__(self) -> None:
        self.val: list[list[float]] = []
        self.test: list[list[float]] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.append(outputs["preds"].flatten().tolist() + outputs["target"].flatten().tolist())

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.test.append(outputs["preds"].flatten().tolist())


class EpochEnd(pl.LightningModule):
    def __init__(self, dirpath: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )
        self.train_mse = torchmetrics.MeanSquaredError()
        self.val_metrics = torchmetrics.MetricCollection(
            {"mae": torchmetrics.MeanAbsoluteError(), "auroc": torchmetrics.classification.BinaryAUROC()}
        )
        self.dirpath = dirpath
        self.lrs: list[float] = []
        self.computed: list[float] = []  # what compute() returned here (NaN on a stage without updates)
        self.epoch_metrics: list[dict[str, float]] = []  # what the monitoring callbacks read, every epoch
        self.training_step_outputs: list[torch.Tensor] = []
        self.validation_step_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layers(x)
        self.train_mse.update(out.detach(), y)
        loss = F.mse_loss(out, y)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_start(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self):
        # the plateau scheduler's rate after the last epoch
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_epoch_end(self):
        value = self.train_mse.compute()
        self.computed.append(float(value))
        self.log("train_mse", value)
        self.log("train_mse_x2", value * 2, on_epoch=True)
        self.train_mse.reset()
        self.log("train_avg", torch.stack(self.training_step_outputs).mean())
        self.training_step_outputs.clear()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.layers(x)
        self.val_metrics["mae"].update(out, y)
        self.val_metrics["auroc"].update(out.flatten().sigmoid(), (y.flatten() > 0).long())
        self.validation_step_outputs.append(F.mse_loss(out, y))

    def on_validation_epoch_end(self):
        values = self.val_metrics.compute()
        self.log_dict({f"val_{k}": v for k, v in values.items()})
        self.val_metrics.reset()
        self.log("val_avg", torch.stack(self.validation_step_outputs).mean())
        self.validation_step_outputs.clear()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        plateau = lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.05)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_mse"}}


class _Monitored(pl.Callback):
    """Records the epoch-end keys the monitoring callbacks read, after each epoch (on every rank)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        keys = ("train_mse", "train_mse_x2", "val_mae", "val_auroc", "train_avg", "val_avg")
        pl_module.epoch_metrics.append({k: float(trainer.callback_metrics[k]) for k in keys})


class BatchNormNet(pl.LightningModule):
    def __init__(self, per_micro_batch: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # float64: statistics of 2 samples amplify the round-off of another summation order
        self.layers = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(),
            nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1),
        ).double()  # fmt: skip
        self.per_micro_batch = per_micro_batch  # one device, as the pipeline runs it: 2 samples at a time
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.per_micro_batch:
            out = torch.cat([self.layers(part) for part in x.split(2)])
        else:
            out = self.layers(x)
        loss = F.mse_loss(out, y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Tokens(Dataset):
    def __init__(self, rows: int = 32, length: int = 10) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (rows, length), generator=g)
        self.labels = torch.randint(0, VOCAB, (rows, length), generator=g)
        for r in range(rows):
            self.labels[r, 1 + (r * 7) % length :] = -100  # 1..10 valid tokens per row

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class TokenLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB)
        )
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.items: list[int] = []

    def training_step(self, batch, batch_idx):
        logits = self.layers(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)
        self.log("train_loss", loss)
        return {"loss": loss, "num_items": (batch["labels"] != -100).sum()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.items.append(int(outputs["num_items"]))
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Declares(nn.Module):
    """A Linear declaring a per-sample mean penalty of its output as an aux loss (a VAE-style KL)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        y = self.linear(x)
        return aux_loss(y, 0.1 * y.pow(2).mean())


class Whole(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(16, 32), Declares(32), nn.Tanh(), nn.Linear(32, 32), Declares(32), nn.Linear(32, 1)
        )
        self.counts: list[int] = []
        self.norms: list[dict[str, float]] = []
        self.inf: list[float] = []
        self.clipped: list[float] = []
        self.aux: list[float] = []
        self.logged: list[float | None] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def on_after_backward(self):
        self.counts.append(sum(p.numel() for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        self.norms.append({k: float(v) for k, v in norms.items()})
        self.inf.append(float(grad_norm(self, "inf")["grad_inf_norm_total"]))
        self.clipped.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.aux.append(float(take_aux_losses()))
        value = self.trainer.callback_metrics.get("grad_2.0_norm_total")  # the last stage's: rank 0's
        self.logged.append(None if value is None else float(value))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(strategy, devices: int, **extra):
    kwargs = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=1,
    )
    kwargs.update(extra)
    if strategy is None:
        return pl.Trainer(devices=1, **kwargs)
    return pl.Trainer(devices=devices, strategy=strategy, **kwargs)


def train(case: str, strategy=None, devices: int = 1, trainer: dict | None = None) -> dict:
    """Train ``case`` (``"outputs"``, ``"epoch"``, ``"batchnorm"``, ``"whole"`` or ``"tokens"``) on one
    device (``strategy=None``) or under ``strategy``; what its hooks saw, and the trained state."""
    if case == "outputs":
        model, gather = Outputs(), Gather()
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        t = _trainer(strategy, devices, callbacks=[gather], max_steps=4, **(trainer or {}))
        t.fit(model, DataLoader(data, batch_size=8))
        g = torch.Generator().manual_seed(4)
        val = DataLoader(TensorDataset(torch.randn(12, 16, generator=g), torch.randn(12, 1, generator=g)), 6)
        validated = t.validate(model, val, verbose=False)
        t.test(model, val, verbose=False)
        record = {"seen": model.seen, "mae_steps": model.mae_steps, "mae_epoch": model.mae_epoch}
        record["r2_steps"] = model.r2_steps
        record.update(val=gather.val, test=gather.test, validated=validated)
    elif case == "epoch":
        model = EpochEnd(str((trainer or {}).pop("dirpath")))
        g = torch.Generator().manual_seed(5)
        data = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        val = TensorDataset(torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g))
        checkpoint = ModelCheckpoint(dirpath=model.dirpath, monitor="val_mae", save_top_k=1, filename="best")
        stop = EarlyStopping(monitor="train_mse", patience=1, min_delta=0.05)  # stops after epoch 2
        t = _trainer(
            strategy, devices, max_epochs=6, enable_checkpointing=True,
            callbacks=[_Monitored(), checkpoint, stop], **(trainer or {}),
        )  # fmt: skip
        t.fit(model, DataLoader(data, batch_size=8), DataLoader(val, batch_size=8))
        record = {"lrs": model.lrs, "epoch_metrics": model.epoch_metrics, "stopped": stop.stopped_epoch}
        record.update(epochs=t.current_epoch, best=float(checkpoint.best_model_score))
        record.update(best_path=os.path.basename(checkpoint.best_model_path), computed=model.computed)
    elif case == "batchnorm":
        model = BatchNormNet(per_micro_batch=strategy is None)
        g = torch.Generator().manual_seed(6)
        x, y = torch.randn(24, 16, generator=g), torch.randn(24, 1, generator=g)
        data = TensorDataset(x.double(), y.double())
        t = _trainer(strategy, devices, max_epochs=2, **(trainer or {}))
        t.fit(model, DataLoader(data, batch_size=12))
        record = {"losses": model.losses}
    elif case == "whole":
        model = Whole()
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        t = _trainer(strategy, devices, max_steps=3, **(trainer or {}))
        t.fit(model, DataLoader(data, batch_size=8))
        record = {k: getattr(model, k) for k in ("counts", "norms", "inf", "clipped", "aux", "logged")}
    else:
        model = TokenLM()
        t = _trainer(strategy, devices, max_steps=4, **(trainer or {}))
        t.fit(model, DataLoader(Tokens(), batch_size=8))
        record = {"losses": model.losses, "logged": model.logged, "items": model.items}
    record["rank"] = t.global_rank
    record["state"] = {k: v.detach().clone() for k, v in model.layers.state_dict().items()}
    return record
