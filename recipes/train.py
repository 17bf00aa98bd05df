"""The main job: train a recipe model through the GPipe strategy, configured by Hydra (``conf/``).

    python recipes/train.py                                 # Transformer LM, stdlib bytes, 2 stages, CPU
    python recipes/train.py model=amoebanet data=digits     # AmoebaNet-D on scikit-learn digits
    python recipes/train.py pipeline.chunks=32 pipeline.checkpoint=always
    python recipes/train.py -m pipeline.chunks=1,4,8        # a sweep: one job of 2 processes per value

Every process of a job runs this script (Lightning's launcher starts ranks 1.. with the job's
own overrides; see :mod:`lightning_gpipe.launcher`) and writes into the job's output directory:
``.hydra/config.yaml`` (rank 0), ``metrics.csv`` and ``hparams.yaml`` (CSVLogger),
``tensorboard/`` when tensorboard is installed, and ``checkpoints/`` (best and last).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import pytorch_lightning as pl
from hydra.utils import get_class, instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.launcher import GPipeLauncher

__all__ = ["Throughput", "build_data", "build_strategy", "main", "train"]

log = logging.getLogger(__name__)

# The CSV logger writes metrics.csv into the job directory, which already holds Hydra's files.
warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")

# Keys of a data config that describe the data for the model config to read (``${data.num_classes}``)
# and are not arguments of the data module.
DESCRIPTIVE_KEYS = ("num_classes", "vocab_size", "channels")
# Keys of a data config holding file-system paths, taken relative to the directory the job started in.
PATH_KEYS = ("path", "root")


class Throughput(Callback):
    """Training samples per second over the wall time of training batches.

    A batch's time runs from ``on_train_batch_start`` to ``on_train_batch_end``: forward,
    backward and optimizer step, without data loading, validation or checkpointing. Its sample
    count is the first dimension of the batch's first tensor.

    Args:
        warmup (int): batches left out at the start (start-up, first allocations) (default: 5);
            when a run has no more batches than that, all are counted.

    Attributes:
        samples (int), seconds (float): counted after the warmup; ``all_samples``, ``all_seconds``
            over every batch.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.samples = self.all_samples = 0
        self.seconds = self.all_seconds = 0.0
        self._batches = 0
        self._start = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = time.perf_counter() - self._start
        samples = _batch_size(batch)
        self._batches += 1
        self.all_samples += samples
        self.all_seconds += seconds
        if self._batches > self.warmup:
            self.samples += samples
            self.seconds += seconds

    @property
    def samples_per_second(self) -> float:
        """Samples per second after the warmup (all batches if none came after it); NaN before any."""
        samples, seconds = (
            (self.samples, self.seconds) if self.samples else (self.all_samples, self.all_seconds)
        )
        return samples / seconds if seconds > 0 else math.nan


def _batch_size(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 0


def build_data(cfg: DictConfig) -> pl.LightningDataModule:
    """Instantiate a data config (``cfg.data``).

    Keys in :data:`DESCRIPTIVE_KEYS` that the data module does not take as arguments are there
    for the model config to read; they are checked against the class attribute of that name
    when there is one, and not passed. Relative paths in :data:`PATH_KEYS` are made absolute
    against the directory the job started in (``hydra.utils.to_absolute_path``), so every rank
    reads the same file whether or not Hydra changed the working directory.

    Args:
        cfg (DictConfig): a config with ``_target_`` naming a ``LightningDataModule`` class.

    Returns:
        pl.LightningDataModule: the data module (not yet set up).

    Raises:
        ValueError: if a descriptive key disagrees with the class, e.g. ``num_classes: 100``
            for the 10-class digits.
    """
    target = get_class(cfg._target_)
    accepted = inspect.signature(target).parameters
    node = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(node, dict)
    for key in DESCRIPTIVE_KEYS:
        if key in node and key not in accepted:
            value, declared = node.pop(key), getattr(target, key, None)
            if declared is not None and declared != value:
                raise ValueError(
                    f"data.{key} does not match {target.__name__}.{key} (data.{key}: {value}, "
                    f"{target.__name__}.{key}: {declared})"
                )
    for key in PATH_KEYS:
        if isinstance(node.get(key), str):
            node[key] = to_absolute_path(node[key])
    return instantiate(node)


def build_strategy(cfg: DictConfig, model: nn.Module | None = None) -> GPipeStrategy:
    """A :class:`~lightning_gpipe.GPipeStrategy` from a pipeline config (``cfg.pipeline``).

    Args:
        cfg (DictConfig): ``stages``, ``chunks``, ``balance`` (a list, or ``uniform`` /
            ``parameters`` / ``time`` / ``memory``), ``checkpoint`` and optionally ``timeline``
            and ``deferred_batch_norm`` (``null``: on when ``model`` has BatchNorm layers).
        model (nn.Module | None): the LightningModule, to decide ``deferred_batch_norm``.

    Returns:
        GPipeStrategy: with ``pipeline_parallel_size = stages``.
    """
    balance = cfg.balance
    if balance is not None and not isinstance(balance, str):
        balance = OmegaConf.to_container(balance)
    deferred = cfg.get("deferred_batch_norm")
    if deferred is None:  # on when the model normalises with BatchNorm (AmoebaNet), as GPipe does
        deferred = model is not None and any(isinstance(m, _BatchNorm) for m in model.modules())
    return GPipeStrategy(
        chunks=int(cfg.chunks),
        balance=balance,  # type: ignore[arg-type]
        checkpoint=str(cfg.checkpoint),
        pipeline_parallel_size=int(cfg.stages),
        timeline=bool(cfg.get("timeline", False)),
        deferred_batch_norm=bool(deferred),
    )


def _loggers(output_dir: Path) -> list[Logger]:
    loggers: list[Logger] = [CSVLogger(save_dir=output_dir, name="", version="")]  # output_dir/metrics.csv
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(save_dir=output_dir, name="", version="tensorboard"))
    return loggers


def _release(trainer: pl.Trainer, failed: bool) -> None:
    """Undo the launch in the launching process (see :meth:`GPipeLauncher.release`)."""
    launcher = trainer.strategy.launcher
    if not isinstance(launcher, GPipeLauncher):
        return
    if not failed:
        launcher.release()
        return
    try:
        launcher.release(timeout=10.0)
    except Exception as err:  # the job's own error is the one to see
        log.warning(f"train: after the failure, {err}")


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, Tensor) else value)


def train(cfg: DictConfig) -> dict[str, float]:
    """Seed, build data, model, strategy and Trainer from ``cfg``, fit, and summarise.

    Every rank runs this function. Rank 0 (the last pipeline stage) prints the summary: final
    training and validation metrics, the validation unigram entropy when the data module has
    one (a language model must go below it), training throughput, stages and chunks.

    Args:
        cfg (DictConfig): the composed ``conf/train.yaml``.

    Returns:
        dict[str, float]: the Trainer's final ``callback_metrics`` (``train_loss``,
        ``val_loss``, ...), ``best_<monitor.metric>``, ``samples_per_s``, ``stages``,
        ``chunks``, ``wall_s`` and, for text, ``val_unigram_entropy``.

    Raises:
        ValueError, PartitionError: for bad sizes or pipeline settings, before any process
            starts where possible.
    """
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)
    datamodule = build_data(cfg.data)
    model: pl.LightningModule = instantiate(cfg.model, _convert_="all")
    strategy = build_strategy(cfg.pipeline, model)
    stages, replicas = int(cfg.pipeline.stages), int(cfg.pipeline.get("replicas", 1))
    throughput = Throughput(warmup=int(cfg.get("throughput_warmup", 5)))
    checkpoint = ModelCheckpoint(
        dirpath=output_dir / "checkpoints",
        filename="epoch{epoch:03d}-step{step}",
        auto_insert_metric_name=False,
        monitor=cfg.monitor.metric,
        mode=cfg.monitor.mode,
        save_last=True,
    )
    loggers = _loggers(output_dir)
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        devices=stages * replicas,
        strategy=strategy,
        logger=loggers,
        callbacks=[checkpoint, throughput],
        default_root_dir=str(output_dir),
    )
    pipeline = {
        key: cfg.pipeline.get(key) for key in ("stages", "replicas", "chunks", "balance", "checkpoint")
    }
    for logger in loggers:
        logger.log_hyperparams(
            {**pipeline, "seed": cfg.seed, "model": cfg.model._target_, "data": cfg.data._target_}
        )
    entropy = getattr(datamodule, "val_unigram_entropy", None)  # reads the corpus (every rank: cheap)

    ckpt_path = to_absolute_path(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except BaseException:
        _release(trainer, failed=True)
        raise
    _release(trainer, failed=False)

    metrics = {key: _float(value) for key, value in trainer.callback_metrics.items()}
    if checkpoint.best_model_score is not None:
        metrics[f"best_{cfg.monitor.metric}"] = _float(checkpoint.best_model_score)
    metrics.update(
        samples_per_s=throughput.samples_per_second,
        stages=float(stages),
        chunks=float(cfg.pipeline.chunks),
        wall_s=time.perf_counter() - start,
    )
    if entropy is not None:
        metrics["val_unigram_entropy"] = float(entropy)
    if trainer.is_global_zero:
        print(summary(metrics, output_dir, checkpoint.best_model_path), flush=True)
    return metrics


def summary(metrics: dict[str, float], output_dir: Path, best_path: str = "") -> str:
    """The end-of-job lines: metrics, throughput, pipeline shape and where the outputs are."""
    shown = sorted(k for k in metrics if k.startswith(("train_", "val_")) and k != "val_unigram_entropy")
    lines = [
        f"[train] {int(metrics['stages'])} stages, {int(metrics['chunks'])} chunks: "
        f"{metrics['samples_per_s']:,.0f} samples/s in training batches; job {metrics['wall_s']:.0f} s",
        "[train] final " + "  ".join(f"{k} {metrics[k]:.4g}" for k in shown),
    ]
    if "val_unigram_entropy" in metrics and "val_loss" in metrics:
        lines.append(
            f"[train] val_loss {metrics['val_loss']:.4f} vs. unigram entropy "
            f"{metrics['val_unigram_entropy']:.4f} nats/byte (a context-free model's best)"
        )
    lines.append(
        f"[train] outputs in {output_dir}: metrics.csv, checkpoints/ (best: {Path(best_path).name or '-'})"
    )
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """CLI entry: train and return the monitored metric (what a Hydra sweeper optimizes)."""
    return train(cfg).get(cfg.monitor.metric, math.nan)


if __name__ == "__main__":
    main()
