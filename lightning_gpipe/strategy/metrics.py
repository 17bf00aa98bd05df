"""The last stage's losses and metrics, seen by every rank.

Only the last stage of a pipeline computes the user's loss, metrics and ``self.log`` calls.
Lightning's callbacks run on every rank, though, and ``ModelCheckpoint(monitor=...)``,
``EarlyStopping`` and metric-monitoring LR schedulers must decide the same everywhere. After
every step the last stage's outcome reaches the other stages (:mod:`lightning_gpipe.engine.outcome`);
the epoch-level values (``on_epoch=True`` aggregates, computed at the end of a training or
validation epoch) are broadcast over each pipeline here: before the epoch-end callbacks run, and
again after the LightningModule's ``on_train_epoch_end``, whose keys Lightning's monitoring
callbacks (``ModelCheckpoint``, ``EarlyStopping``) and ``ReduceLROnPlateau`` read next (Lightning
runs them after the module's hook for that reason: ``fit_loop.on_advance_end``; issue 40, kind D).
Validation and test keys are shared at ``on_validation_end`` / ``on_test_end``, after the module's
``on_validation_epoch_end`` / ``on_test_epoch_end``. Those hooks, on the other stages, may fail for
want of step outputs: :mod:`lightning_gpipe.strategy.epoch_end` settles that in the share that follows.

torchmetrics metrics sync over the last stage's data-parallel replicas only. On the other stages a
metric never syncs (torchmetrics decides with ``Metric._to_sync`` and ``distributed_available_fn``,
both turned off here: setting ``sync_on_compute`` alone does not refresh ``_to_sync``), and its
``compute()``, of a state that saw no update, returns what torchmetrics computes from the empty
state or, where that raises, a NaN scalar. Logging calls on the other stages are dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from torch import nn
from torchmetrics import Metric

from lightning_gpipe._lightning import attached_trainer, distributed_is_initialized
from lightning_gpipe.strategy._namespace import PYTORCH_LIGHTNING, namespace_of, specialize
from lightning_gpipe.strategy.epoch_end import guard_epoch_end_hooks, resolve_held, unguard_epoch_end_hooks
from lightning_gpipe.transport.groups import tensors_to_cpu
from lightning_gpipe.transport.layout import Layout

if TYPE_CHECKING:
    _Base = Callback
else:
    _Base = object


def share_last_stage_metrics(trainer: pl.Trainer, src: int, group: Any, device: torch.device) -> None:
    """Broadcast ``trainer.callback_metrics`` from global rank ``src`` (a last stage) over ``group``
    (its pipeline)."""
    rank = dist.get_rank()
    box = [tensors_to_cpu(dict(trainer.callback_metrics)) if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if rank != src:
        metrics = trainer.callback_metrics
        metrics.clear()
        metrics.update({k: v.to(device) for k, v in (box[0] or {}).items()})


def share_over_pipeline(
    trainer: pl.Trainer,
    layout: Layout,
    rank: int,
    group: Any,
    device: torch.device,
    arrive: Callable[[str, list[int]], None],
) -> None:
    """Give every stage of ``rank``'s pipeline (``group``) its last stage's ``trainer.callback_metrics``,
    after ``arrive(operation, ranks)``: all of the pipeline's ranks must come. Nothing with one stage."""
    if layout.stages == 1 or not distributed_is_initialized():
        return
    replica, tensor = layout.replica_of(rank), layout.tensor_of(rank)
    src = layout.rank(replica, layout.stages - 1, tensor)
    arrive(f"sharing epoch metrics over pipeline {replica}", layout.pipeline_ranks(replica, tensor))
    share_last_stage_metrics(trainer, src, group, device)


class _ShareLastStageMetricsLogic(_Base):
    """Runs first among callbacks and calls ``share()`` where Lightning's epoch-end callbacks read metrics.

    Args:
        share: shares the last stage's ``callback_metrics`` with the rest of the pipeline.
    """

    def __init__(self, share: Any) -> None:
        self.share = share

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.share(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.share(trainer)  # also in the sanity check: it settles the module's held epoch-end errors

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.share(trainer)


class ShareLastStageMetrics(_ShareLastStageMetricsLogic, Callback):
    __doc__ = _ShareLastStageMetricsLogic.__doc__
    namespace = PYTORCH_LIGHTNING


def install_metric_sharing(trainer: pl.Trainer, share: Any, last_stage: bool = True) -> ShareLastStageMetrics:
    """Put a :class:`ShareLastStageMetrics` (of the Trainer's namespace) first among ``trainer``'s
    callbacks, and guard its LightningModule's epoch-end hooks
    (:func:`~lightning_gpipe.strategy.epoch_end.guard_epoch_end_hooks`; ``last_stage``: this rank's
    stage is its pipeline's last): the module's ``on_train_epoch_end`` shares after its own code, and on
    other stages the hooks' errors are settled by the share that follows."""
    held: dict[str, Any] = {}

    def share_settling(trainer: pl.Trainer) -> None:
        resolve_held(lambda: share(trainer), held)

    callback = specialize(ShareLastStageMetrics, namespace_of(trainer) or PYTORCH_LIGHTNING)(share_settling)
    trainer.callbacks.insert(0, callback)  # type: ignore[attr-defined]
    guard_epoch_end_hooks(trainer.lightning_module, last_stage, lambda: share(trainer), held)
    return callback


def evaluation_results(results: Any, trainer: Any, from_last_stage: Callable[[Any], Any]) -> Any:
    """``trainer.validate``/``test``'s return value ``results``: the last stage's, on every stage of its
    pipeline (``from_last_stage``); other calls' ``results`` as they are.

    Only the last stage logs; as under DDP, every rank returns the logged metrics.
    """
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    if getattr(fn, "value", None) not in ("validate", "test"):
        return results
    return from_last_stage(results)


def remove_metric_sharing(module: pl.LightningModule | None, callback: ShareLastStageMetrics | None) -> None:
    """Undo :func:`install_metric_sharing` (and :func:`silence_logging`) on ``module``'s trainer."""
    trainer = attached_trainer(module) if module is not None else None
    if callback is not None and trainer is not None and callback in trainer.callbacks:  # type: ignore[attr-defined]
        trainer.callbacks.remove(callback)  # type: ignore[attr-defined]
    unguard_epoch_end_hooks(module)
    restore_logging(module)


def sync_metrics_over(module: nn.Module | None, group: Any, member: bool) -> None:
    """torchmetrics metrics live on the last stage: sync them over its data-parallel replicas only.

    Args:
        group: the last stage's data-parallel group.
        member: whether this rank is in ``group``; the other stages' metrics never sync (they
            have no data to sync, and a collective they are not part of would only warn).
    """
    for m in module.modules() if module is not None else ():
        if isinstance(m, Metric):
            m.process_group = group if member else None
            if not member:
                m.sync_on_compute = False
                m.dist_sync_on_step = False
                m._to_sync = False  # what torchmetrics reads; set from sync_on_compute only in __init__
                m.distributed_available_fn = _not_distributed
                if not getattr(vars(m).get("compute"), "harmless", False):
                    m.compute = _harmless_compute(m, m.compute)  # type: ignore[method-assign]


def _not_distributed() -> bool:
    """A non-last stage's metric syncs with nobody (torchmetrics' ``distributed_available_fn``)."""
    return False


def _harmless_compute(metric: Metric, compute: Callable[..., Any]) -> Callable[..., Any]:
    """``metric.compute`` on a stage that computes no loss: torchmetrics' value of the state as it is,
    or, when the metric saw no update there and that raises (``dim_zero_cat`` of no samples), a NaN
    scalar instead of an error on only some ranks."""

    @functools.wraps(compute)
    def harmless(*args: Any, **kwargs: Any) -> Any:
        try:
            return compute(*args, **kwargs)
        except Exception:
            if metric.update_called:
                raise
            return torch.tensor(float("nan"))

    harmless.harmless = True  # type: ignore[attr-defined]
    return harmless


def silence_logging(module: pl.LightningModule | None) -> None:
    """Non-last stages compute no loss or metric: their ``self.log`` calls (in epoch hooks) are dropped."""
    if module is not None:
        module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
        module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]


def metrics_on_last_stage(module: pl.LightningModule | None, group: Any, last_stage: bool) -> None:
    """The module's metrics sync over the last stage's replicas (``group``); other stages log nothing."""
    sync_metrics_over(module, group, last_stage)
    if not last_stage:
        silence_logging(module)


def restore_logging(module: pl.LightningModule | None) -> None:
    """Undo :func:`silence_logging`."""
    if module is not None:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)
