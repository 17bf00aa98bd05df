"""LightningModules of the recipes, written as plain single-device code.

Each keeps every parameter inside ``self.layers`` (one ``nn.Sequential``), calls it exactly
once per step through ``self(x)`` and uses only its output afterwards, which is what the
GPipe strategy needs to pipeline it unchanged (see ``DESIGN.md``, "The user's contract").
``LanguageModel`` and :mod:`recipes.hf_modules`' ``HFLanguageModel`` share the next-token steps and
optimizer (``NextTokenSteps``), ``ImageClassifier`` and ``HFImageClassifier`` the classification
ones (``ClassifierSteps``). This module needs no ``transformers``: the ``HF`` modules, which do,
live in :mod:`recipes.hf_modules`.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from recipes.models.amoebanet import build_amoebanet
from recipes.models.transformer import build_transformer

__all__ = [
    "ClassifierSteps",
    "ImageClassifier",
    "LanguageModel",
    "NextTokenSteps",
    "warmup_cosine",
]

IGNORE = -100  # the target of a padded position: no loss


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_ratio``.

    Warmup follows Goyal et al. (2017, arXiv 1706.02677); the cosine decay follows SGDR
    (Loshchilov & Hutter, 2017, arXiv 1608.03983) without restarts.

    Args:
        step (int): optimizer steps taken so far.
        warmup_steps (int): steps of linear warmup from ``1 / warmup_steps`` to 1.
        total_steps (int): step at which the multiplier reaches ``min_ratio``; held afterwards.
        min_ratio (float): final multiplier (default: 0.1).

    Returns:
        float: the multiplier, in ``(0, 1]``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _schedule(
    module: pl.LightningModule, optimizer: torch.optim.Optimizer, warmup_steps: int
) -> dict[str, Any]:
    total = module.hparams.get("total_steps") or module.trainer.estimated_stepping_batches
    total = int(total) if math.isfinite(total) else 10 * max(1, warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)} ({name}: {value!r})")


def _decay_groups(layers: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on parameters of rank ≥ 2 only (each parameter once, a tied one included)."""
    decay = [p for p in layers.parameters() if p.ndim >= 2]
    no_decay = [p for p in layers.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class NextTokenSteps(pl.LightningModule):
    """Next-token cross-entropy over ``self.layers``, AdamW and the warmup-cosine schedule.

    A subclass sets ``self.layers`` (ids ``(N, T)`` → logits ``(N, T, vocab)``) and saves the
    hyperparameters ``lr``, ``weight_decay``, ``betas``, ``scheduler``, ``warmup_steps`` and
    ``total_steps``, then calls :meth:`_add_metrics`.

    The loss is a mean over the targets that are not ``-100`` (padding of an SFT batch), returned
    with their count as ``num_items`` (docs/lightning.md, "Token-count losses"), so a padded batch
    trains as on one device under every schedule.

    Shapes:
        batch: ``((N, T), (N, T))`` int64 inputs and targets, or ``({"input_ids": (N, T),
        "attention_mask": (N, T)}, (N, T))`` with targets ``-100`` on padding (the transformers
        models only); ``forward``: ``(N, T)`` → ``(N, T, vocab)``.

    Logs:
        ``train_loss`` (nats/token, progress bar), ``train_ppl``, ``val_loss``, ``val_ppl``.
    """

    layers: nn.Module

    def _add_metrics(self) -> None:
        self.val_ppl = Perplexity(ignore_index=IGNORE)
        self.val_loss = MeanMetric()

    def forward(self, x: Any) -> Tensor:
        """``(N, T)`` int64 ids (or a dict: ``input_ids``, ``attention_mask``) → ``(N, T, vocab)`` logits."""
        return self.layers(x)

    def training_step(self, batch: tuple[Any, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", loss.detach().exp())
        return {"loss": loss, "num_items": (y != IGNORE).sum()}  # a mean over the real tokens

    def validation_step(self, batch: tuple[Any, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        self.val_loss.update(loss, weight=(y != IGNORE).sum())
        self.val_ppl.update(logits, y)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            _decay_groups(self.layers, hp["weight_decay"]), lr=hp["lr"], betas=tuple(hp["betas"])
        )
        if hp["scheduler"] == "none":
            return optimizer
        return _schedule(self, optimizer, hp["warmup_steps"])


class LanguageModel(NextTokenSteps):
    """Next-token language model on :func:`~recipes.models.transformer.build_transformer`.

    The defaults are the CPU recipe (byte vocabulary, 4 layers, ``d_model`` 128, context
    64; 0.87 M parameters): on the standard-library byte corpus it goes well below the
    corpus' unigram entropy within about three minutes on two CPU cores.

    Args:
        vocab_size (int): vocabulary (default: 256, bytes).
        num_layers (int): decoder blocks (default: 4).
        d_model (int): model width (default: 128).
        num_heads (int): attention heads (default: 4).
        d_ff (int): MLP width (default: 512).
        seq_len (int): context length in tokens (default: 64).
        dropout (float): dropout probability (default: 0.0).
        lr (float): AdamW peak learning rate (default: 3e-3).
        weight_decay (float): AdamW decoupled weight decay (Loshchilov & Hutter, 2019) on
            matrices only, not on biases, norms or embeddings (default: 0.01).
        betas (tuple[float, float]): AdamW betas (default: (0.9, 0.99)).
        scheduler (str): ``"cosine"`` (warmup + cosine, stepped per optimizer step) or
            ``"none"`` (default: ``"cosine"``).
        warmup_steps (int): warmup length in optimizer steps (default: 100).
        total_steps (int | None): cosine length; ``None`` uses the trainer's estimate (default: None).

    Shapes:
        batch: ``((N, T), (N, T))`` int64 inputs and targets; ``forward``: ``(N, T)`` → ``(N, T, vocab)``.

    Logs:
        ``train_loss`` (nats/token, progress bar), ``train_ppl``, ``val_loss``, ``val_ppl``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        num_layers: int = 4,
        d_model: int = 128,
        num_heads: int = 4,
        d_ff: int = 512,
        seq_len: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.99),
        scheduler: str = "cosine",
        warmup_steps: int = 100,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        if scheduler not in ("cosine", "none"):
            raise ValueError(f"scheduler must be 'cosine' or 'none' (scheduler: {scheduler!r})")
        self.save_hyperparameters()
        self.layers = build_transformer(vocab_size, num_layers, d_model, num_heads, d_ff, seq_len, dropout)
        self._add_metrics()


class ClassifierSteps(pl.LightningModule):
    """Cross-entropy classification over ``self.layers``, SGD (Nesterov) or AdamW, warmup-cosine.

    A subclass sets ``self.layers`` (images ``(N, C, H, W)`` → logits ``(N, num_classes)``) and
    saves the hyperparameters ``optimizer``, ``lr``, ``momentum``, ``weight_decay``,
    ``label_smoothing``, ``scheduler``, ``warmup_steps`` and ``total_steps``, then calls
    :meth:`_add_metrics`.

    Shapes:
        batch: ``((N, C, H, W) float, (N,) int64)``; ``forward``: ``(N, C, H, W)`` → ``(N, num_classes)``.

    Logs:
        ``train_loss`` (progress bar), ``val_loss``, ``val_acc`` (top-1, in [0, 1]).
    """

    layers: nn.Module

    def _add_metrics(self, num_classes: int) -> None:
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro")
        self.val_loss = MeanMetric()

    def forward(self, x: Tensor) -> Tensor:
        """``(N, C, H, W)`` images → ``(N, num_classes)`` logits."""
        return self.layers(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=self.hparams["label_smoothing"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y), weight=y.numel())
        self.val_acc.update(logits, y)
        self.log("val_loss", self.val_loss)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        groups = _decay_groups(self.layers, hp["weight_decay"])
        optimizer: torch.optim.Optimizer
        if hp["optimizer"] == "sgd":
            optimizer = torch.optim.SGD(groups, lr=hp["lr"], momentum=hp["momentum"], nesterov=True)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp["lr"])
        if hp["scheduler"] == "none":
            return optimizer
        return _schedule(self, optimizer, hp["warmup_steps"])


class ImageClassifier(ClassifierSteps):
    """Image classifier on AmoebaNet-D (:func:`~recipes.models.amoebanet.build_amoebanet`).

    The defaults are the CPU recipe for 32×32 scikit-learn digits (``(L, D)`` = (3, 32)).

    Args:
        num_classes (int): classes (default: 10).
        num_layers (int): ``L``, normal cells, a multiple of 3 (default: 3).
        num_filters (int): ``D``, filters, a multiple of 16 (default: 32).
        in_channels (int): image channels (default: 3).
        optimizer (str): ``"sgd"`` (Nesterov momentum) or ``"adamw"`` (default: ``"adamw"``).
        lr (float): peak learning rate (default: 3e-3).
        momentum (float): SGD momentum (default: 0.9).
        weight_decay (float): weight decay, on weights of rank ≥ 2 only (default: 5e-4).
        label_smoothing (float): cross-entropy label smoothing (default: 0.0).
        scheduler (str): ``"cosine"`` or ``"none"`` (default: ``"cosine"``).
        warmup_steps (int): warmup in optimizer steps (default: 20).
        total_steps (int | None): cosine length; ``None`` uses the trainer's estimate (default: None).

    Shapes:
        batch: ``((N, C, H, W) float, (N,) int64)``; ``forward``: ``(N, C, H, W)`` → ``(N, num_classes)``.

    Logs:
        ``train_loss`` (progress bar), ``val_loss``, ``val_acc`` (top-1, in [0, 1]).
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_layers: int = 3,
        num_filters: int = 32,
        in_channels: int = 3,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.0,
        scheduler: str = "cosine",
        warmup_steps: int = 20,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw' (optimizer: {optimizer!r})")
        if scheduler not in ("cosine", "none"):
            raise ValueError(f"scheduler must be 'cosine' or 'none' (scheduler: {scheduler!r})")
        self.save_hyperparameters()
        self.layers = build_amoebanet(num_classes, num_layers, num_filters, in_channels)
        self._add_metrics(num_classes)
