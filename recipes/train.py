"""The main job: train a recipe model through the GPipe strategy, configured by Hydra (``conf/``).

    python recipes/train.py                                 # Transformer LM, stdlib bytes, 2 stages, CPU
    python recipes/train.py model=amoebanet data=digits     # AmoebaNet-D on scikit-learn digits
    python recipes/train.py model=gpt2 pipeline.chunks=8    # transformers GPT-2 (also llama, resnet, vit)
    python recipes/train.py pipeline.chunks=32 pipeline.checkpoint=always
    python recipes/train.py -m pipeline.chunks=1,4,8        # a sweep: one job of 2 processes per value
    python recipes/train.py -m pipeline.schedule=gpipe,1f1b # fill-drain, then 1F1B
                                                            # (training_step per micro-batch)

Every process of a job runs this script (Lightning's launcher starts ranks 1.. with the job's
own overrides, see :mod:`lightning_gpipe.strategy.launcher`; ``torchrun``, ``srun`` or submitit
start every rank themselves, see :mod:`recipes.cluster`) and writes into the one output directory of the job,
the one rank 0 resolved: ``.hydra/config.yaml`` (rank 0), ``metrics.csv`` and ``hparams.yaml``
(CSVLogger), ``tensorboard/`` when tensorboard is installed, ``checkpoints/`` (best and last) and
the log files ``train.log`` (rank 0) and ``train_rank<r>.log``.

``checkpoints/last.ckpt`` is written every ``checkpoint.every_n_steps`` optimizer steps (or
``checkpoint.every_minutes``) from the start, at each validation, at the end of training and where
``SIGTERM`` stopped the job. A stopped job resumes into its own directory, continuing its
``metrics.csv`` and keeping its best checkpoint::

    python recipes/train.py hydra.run.dir=<its directory> ckpt_path=last
"""

from __future__ import annotations

import csv
import datetime
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
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint, ThroughputMonitor
from pytorch_lightning.loggers import Logger, TensorBoardLogger
from pytorch_lightning.utilities.data import extract_batch_size
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.strategy.launcher import GPipeLauncher
from recipes.cluster import SharedOutputDir, cluster_environment
from recipes.last_checkpoint import LastCheckpoint
from recipes.resumable_csv_logger import ResumableCSVLogger

__all__ = ["build_data", "build_strategy", "checkpoint_callbacks", "main", "num_devices", "summary", "train"]

log = logging.getLogger(__name__)

# The CSV logger writes metrics.csv into the job directory, which already holds Hydra's files.
warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
# ThroughputMonitor counts samples and time; the recipe's modules define no FLOPs.
warnings.filterwarnings("ignore", message=r".*you need to define a `flops_per_batch` attribute")

# Keys of a data config that describe the data for the model config to read (``${data.num_classes}``)
# and are not arguments of the data module.
DESCRIPTIVE_KEYS = ("num_classes", "vocab_size", "channels", "resolution")
# Keys of a data config holding file-system paths, taken relative to the directory the job started in.
PATH_KEYS = ("path", "root")
# Keys of the pipeline config that are the recipe's, not GPipeStrategy arguments.
PIPELINE_RECIPE_KEYS = ("replicas",)
# GPipeStrategy arguments the Trainer fills in: not settable from the pipeline config.
TRAINER_FILLED = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)
# Metrics of the whole run (not logged by the module) that monitor.metric may name for a sweeper.
RUN_METRICS = ("throughput", "wall_s")
# What Lightning's ThroughputMonitor logs for training: samples per second through rank 0's pipeline.
THROUGHPUT_KEY = "train/device/samples_per_sec"
# ckpt_path values Lightning resolves itself (not paths): "last" is checkpoints/last.ckpt of the job.
CKPT_NAMES = ("last", "hpc")


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
    """A :class:`~lightning_gpipe.GPipeStrategy` instantiated from a pipeline config (``cfg.pipeline``).

    The config is ``_target_: lightning_gpipe.GPipeStrategy`` with the strategy's own argument
    names, plus the recipe's :data:`PIPELINE_RECIPE_KEYS` (``replicas``), which are not passed.
    ``deferred_batch_norm: null`` turns it on when ``model`` has BatchNorm layers (as GPipe does
    for AmoebaNet). Inside a task of submitit's local executor the strategy gets
    :class:`recipes.cluster.SubmititLocalEnvironment`.

    Args:
        cfg (DictConfig): the pipeline config.
        model (nn.Module | None): the LightningModule, to decide ``deferred_batch_norm: null``.

    Returns:
        GPipeStrategy: the strategy.

    Raises:
        ValueError: for a key that is not a ``GPipeStrategy`` argument (a misspelling, or one the
            Trainer fills in), naming the accepted ones.
    """
    target = get_class(cfg._target_)
    accepted = set(inspect.signature(target).parameters) - set(TRAINER_FILLED)
    given = {str(key) for key in cfg if not str(key).startswith("_")} - set(PIPELINE_RECIPE_KEYS)
    unknown = sorted(given - accepted)
    if unknown:
        raise ValueError(
            f"pipeline config has keys that are not {target.__name__} arguments (unknown: {unknown}); "
            f"use {sorted(accepted)} or the recipe's {list(PIPELINE_RECIPE_KEYS)}"
        )
    node = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(node, dict)
    for key in PIPELINE_RECIPE_KEYS:
        node.pop(key, None)
    if node.get("deferred_batch_norm") is None:  # on when the model normalises with BatchNorm (AmoebaNet)
        node["deferred_batch_norm"] = model is not None and any(
            isinstance(m, _BatchNorm) for m in model.modules()
        )
    environment = cluster_environment()
    if environment is not None:
        node["cluster_environment"] = environment
    return instantiate(node, _convert_="all")


def num_devices(cfg: DictConfig) -> int:
    """Processes per node, ``pipeline_parallel_size × replicas / trainer.num_nodes``: the number of
    processes comes from the pipeline config only.

    Args:
        cfg (DictConfig): the composed ``conf/train.yaml``.

    Returns:
        int: the Trainer's ``devices``.

    Raises:
        ValueError: if ``trainer.devices`` is set and disagrees, or if the processes do not divide
            evenly over ``trainer.num_nodes``.
    """
    stages = int(cfg.pipeline.pipeline_parallel_size)
    replicas = int(cfg.pipeline.get("replicas", 1))
    nodes = int(cfg.trainer.get("num_nodes") or 1)
    world = stages * replicas
    shape = f"pipeline.pipeline_parallel_size × pipeline.replicas: {stages} × {replicas} = {world}"
    if world % nodes:
        raise ValueError(
            f"the job's processes do not divide evenly over the nodes ({shape}, trainer.num_nodes: {nodes}); "
            "change one of them"
        )
    devices = world // nodes
    given = cfg.trainer.get("devices")
    if given is not None and given != devices:
        raise ValueError(
            f"trainer.devices disagrees with the pipeline config (trainer.devices: {given}, {shape} over "
            f"{nodes} node(s) = {devices} per node); the number of processes comes from the pipeline "
            "config: drop trainer.devices, set pipeline.pipeline_parallel_size or pipeline.replicas"
        )
    return devices


def _loggers(output_dir: Path, resume: bool) -> list[Logger]:
    """CSV (``output_dir/metrics.csv``, continued when resuming) and TensorBoard when installed."""
    loggers: list[Logger] = [ResumableCSVLogger(save_dir=output_dir, name="", version="", resume=resume)]
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


def checkpoint_callbacks(cfg: DictConfig, output_dir: Path, monitor: str | None) -> list[ModelCheckpoint]:
    """The job's checkpoints in ``output_dir/checkpoints``: the best by ``monitor.metric``, and
    ``last.ckpt`` at each validation, every ``checkpoint.every_n_steps`` steps or
    ``checkpoint.every_minutes`` minutes from the start (so that a job stopped before its first
    validation can resume), at the end of training, and at the step where ``SIGTERM`` (or a first
    ``SIGINT``) stopped the job (:class:`recipes.last_checkpoint.LastCheckpoint`).

    Both write the one ``last.ckpt`` (no ``last-v1.ckpt``), which ``ckpt_path=last`` resumes from.

    Args:
        cfg (DictConfig): the composed ``conf/train.yaml``.
        output_dir (Path): the job's directory.
        monitor (str | None): the metric the best checkpoint is chosen by; ``None``: none kept.

    Returns:
        list[ModelCheckpoint]: the best one first (``trainer.checkpoint_callback``).

    Raises:
        ValueError: if both ``checkpoint.every_n_steps`` and ``checkpoint.every_minutes`` are set,
            or either is not positive.
    """
    steps, minutes = cfg.checkpoint.get("every_n_steps"), cfg.checkpoint.get("every_minutes")
    if steps is not None and minutes is not None:
        raise ValueError(
            f"set one of checkpoint.every_n_steps and checkpoint.every_minutes (every_n_steps: {steps}, "
            f"every_minutes: {minutes}); set the other to null"
        )
    for name, value in (("every_n_steps", steps), ("every_minutes", minutes)):
        if value is not None and not value > 0:
            raise ValueError(f"checkpoint.{name} must be positive or null (checkpoint.{name}: {value})")
    dirpath = output_dir / "checkpoints"
    best = ModelCheckpoint(
        dirpath=dirpath,
        filename="epoch{epoch:03d}-step{step}",
        auto_insert_metric_name=False,
        monitor=monitor,
        mode=cfg.monitor.mode,
        save_last=True,
        enable_version_counter=False,
    )
    interval = LastCheckpoint(  # also writes last.ckpt where a signal stops the job
        dirpath=dirpath,
        enable_version_counter=False,
        every_n_train_steps=int(steps) if steps is not None else None,
        train_time_interval=datetime.timedelta(minutes=float(minutes)) if minutes is not None else None,
    )
    return [best, interval]


def _ckpt_path(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path`` for ``fit``: a name in :data:`CKPT_NAMES` as is, a path made absolute
    against the directory the job started in."""
    path = cfg.get("ckpt_path")
    if not path:
        return None
    return str(path) if str(path) in CKPT_NAMES else to_absolute_path(str(path))


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, Tensor) else value)


def _last_logged(path: Path, key: str) -> float:
    """The last value of column ``key`` in a CSVLogger ``metrics.csv``; NaN if there is none."""
    if not path.is_file():
        return math.nan
    with path.open() as handle:
        values = [row[key] for row in csv.DictReader(handle) if row.get(key)]
    return float(values[-1]) if values else math.nan


def train(cfg: DictConfig) -> dict[str, float]:
    """Seed, build data, model, strategy and Trainer from ``cfg``, fit, and summarise.

    Every rank runs this function. When the data module has a validation unigram entropy
    (text), the loggers get it as ``val_unigram_entropy`` at step 0 (a language model's
    ``val_loss`` must go below it). Rank 0 (the last pipeline stage) logs the summary: final
    training and validation metrics, that entropy, training throughput, the pipeline's shape and the
    files the job wrote. When no validation ran (``trainer.max_steps`` below
    ``trainer.val_check_interval``), a monitored validation metric is NaN and a warning says how
    to get one.

    Throughput is Lightning's :class:`~pytorch_lightning.callbacks.ThroughputMonitor` on rank 0
    (``train/device/samples_per_sec`` in ``metrics.csv``, over the last ``throughput_window``
    batches): the samples through one pipeline per second; ``throughput`` is that times
    ``pipeline.replicas``.

    Args:
        cfg (DictConfig): the composed ``conf/train.yaml``.

    Returns:
        dict[str, float]: the Trainer's final ``callback_metrics`` (``train_loss``,
        ``val_loss``, ...), ``best_<monitor.metric>``, ``throughput`` (samples/s, NaN when fewer
        batches were logged than the window), ``stages``, ``replicas``, ``chunks``, ``wall_s``
        and, for text, ``val_unigram_entropy``.

    Raises:
        ValueError, PartitionError: for bad sizes or pipeline settings, before any process
            starts where possible.
    """
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = build_data(cfg.data)
    model: pl.LightningModule = instantiate(cfg.model, _convert_="all")
    devices = num_devices(cfg)
    strategy = build_strategy(cfg.pipeline, model)
    stages, replicas = int(cfg.pipeline.pipeline_parallel_size), int(cfg.pipeline.get("replicas", 1))
    chdir = HydraConfig.initialized() and bool(HydraConfig.get().job.chdir)
    shared = SharedOutputDir(cfg.paths.output_dir, chdir=chdir)
    output_dir = shared.output_dir
    monitor = None if cfg.monitor.metric in RUN_METRICS else cfg.monitor.metric
    checkpoints = checkpoint_callbacks(cfg, output_dir, monitor)
    checkpoint = checkpoints[0]
    ckpt_path = _ckpt_path(cfg)
    steps = int(cfg.trainer.max_steps)
    window = max(2, min(int(cfg.throughput_window), steps) if steps > 0 else int(cfg.throughput_window))
    throughput = ThroughputMonitor(batch_size_fn=extract_batch_size, window_size=window)
    loggers = _loggers(output_dir, resume=ckpt_path is not None)
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        devices=devices,
        strategy=strategy,
        logger=loggers,
        callbacks=[shared, *checkpoints, throughput],
        default_root_dir=str(output_dir),
    )
    node = OmegaConf.to_container(cfg.pipeline, resolve=True)
    assert isinstance(node, dict)
    pipeline = {k: v for k, v in node.items() if k not in ("_target_", "timeout")}
    entropy = getattr(datamodule, "val_unigram_entropy", None)  # reads the corpus (every rank: cheap)
    for logger in loggers:  # the loggers write on global rank 0 only
        logger.log_hyperparams(
            {**pipeline, "seed": cfg.seed, "model": cfg.model._target_, "data": cfg.data._target_}
        )
        if entropy is not None and not (  # the bar a language model's val_loss must go below
            isinstance(logger, ResumableCSVLogger) and logger.found("val_unigram_entropy")
        ):
            logger.log_metrics({"val_unigram_entropy": float(entropy)}, step=0)

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except BaseException:
        _release(trainer, failed=True)
        raise
    _release(trainer, failed=False)

    output_dir = shared.output_dir  # rank 0's
    metrics = {key: _float(value) for key, value in trainer.callback_metrics.items()}
    if checkpoint.best_model_score is not None:
        metrics[f"best_{cfg.monitor.metric}"] = _float(checkpoint.best_model_score)
    metrics.update(
        throughput=_last_logged(output_dir / "metrics.csv", THROUGHPUT_KEY) * replicas,
        stages=float(stages),
        replicas=float(replicas),
        chunks=float(cfg.pipeline.chunks),
        wall_s=time.perf_counter() - start,
    )
    if entropy is not None:
        metrics["val_unigram_entropy"] = float(entropy)
    if cfg.monitor.metric not in metrics:
        metrics[cfg.monitor.metric] = math.nan
        validated = any(key.startswith("val_") for key in trainer.callback_metrics)
        if trainer.is_global_zero and not validated:
            log.warning(
                f"[train] {cfg.monitor.metric} is NaN: no validation ran (trainer.max_steps: "
                f"{cfg.trainer.max_steps}, trainer.val_check_interval: {cfg.trainer.val_check_interval}); "
                "set trainer.val_check_interval to at most trainer.max_steps"
            )
        elif trainer.is_global_zero:
            log.warning(
                f"[train] {cfg.monitor.metric} is NaN: the module logged no such metric (logged: "
                f"{sorted(trainer.callback_metrics)}); set monitor.metric to one of them or to throughput"
            )
    if trainer.is_global_zero:
        log.info(summary(metrics, output_dir, checkpoint.best_model_path, window))
    return metrics


def summary(metrics: dict[str, float], output_dir: Path, best_path: str = "", window: int = 0) -> str:
    """The end-of-job lines: metrics, throughput, pipeline shape and the files the job wrote.

    Args:
        metrics (dict[str, float]): what :func:`train` returns.
        output_dir (Path): the job's directory; only what exists in it is listed.
        best_path (str): the best checkpoint's path (``""``: none).
        window (int): batches the throughput is measured over.
    """
    shown = sorted(k for k in metrics if k.startswith(("train_", "val_")) and k != "val_unigram_entropy")
    rate = metrics["throughput"]
    measured = (
        f"{rate:,.0f} samples/s over the last {window} training batches"
        if not math.isnan(rate)
        else f"throughput not measured (fewer than {window} training batches logged)"
    )
    lines = [
        f"[train] {int(metrics['stages'])} stages, {int(metrics['chunks'])} chunks: "
        f"{measured}; job {metrics['wall_s']:.0f} s",
        "[train] final " + "  ".join(f"{k} {metrics[k]:.4g}" for k in shown),
    ]
    if "val_unigram_entropy" in metrics and not math.isnan(metrics.get("val_loss", math.nan)):
        lines.append(
            f"[train] val_loss {metrics['val_loss']:.4f} vs. unigram entropy "
            f"{metrics['val_unigram_entropy']:.4f} nats/byte (a context-free model's best)"
        )
    files = []
    for path in sorted(output_dir.iterdir()) if output_dir.is_dir() else []:
        if path.name.startswith("."):
            continue
        if path.name == "checkpoints" and path.is_dir():
            saved = sorted(p.name for p in path.iterdir())
            best = Path(best_path).name if best_path and Path(best_path).exists() else ""
            files.append(f"checkpoints/ ({', '.join(saved)}{'; best: ' + best if best else ''})")
        else:
            files.append(path.name + ("/" if path.is_dir() else ""))
    lines.append(f"[train] outputs in {output_dir}: {', '.join(files) or 'none'}")
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """CLI entry: train and return ``monitor.metric`` (what a Hydra sweeper optimizes; NaN if none)."""
    return train(cfg)[cfg.monitor.metric]


if __name__ == "__main__":
    main()
