"""BatchNorm under micro-batches: as on one device, or GPipe's per-micro-batch statistics when asked.

In training a BatchNorm normalizes its input by the input's own mean and variance. The pipeline
runs each layer on one micro-batch at a time, so each micro-batch is normalized by its own
statistics (GPipe, Huang et al. 2019, section 2.2): with M > 1 micro-batches the step differs
from the same model on the whole batch, and a micro-batch of one sample breaks it
(``BatchNorm1d`` raises "Expected more than 1 value per channel when training", a ``BatchNorm2d``
normalizes each image by itself) where one device trains (issue 40, kind E). Whole-batch
statistics with M > 1 would need every stage to stop at every BatchNorm, which is ``chunks=1``.

``GPipeStrategy(batch_norm=...)`` (:func:`check_batch_norm`) chooses:

- ``"batch"`` (the default, as on one device): :func:`refuse_training_batch_norm` makes every
  BatchNorm of the stage raise :class:`~lightning_gpipe.errors.PipelineUsageError` at a forward in
  training mode within a training step split into M > 1 micro-batches, before any backward,
  naming the layer and the fixes. The check reads the layer's ``training`` flag at that call:
  BatchNorm the user put in eval mode (frozen, as in fine-tuning) trains with any M, and evaluation
  steps are never refused. It cannot be decided before the processes start or at setup (the
  user's hooks may freeze the layers later), so it is made at each forward. Training splits as
  ``chunks`` says (no floor: a frozen BatchNorm takes micro-batches of one sample).
- ``"micro_batch"`` (GPipe's semantics, chosen by the user): :func:`keep_two_samples` makes the
  stage split a training batch of N samples into at most ``N // 2`` micro-batches when the whole
  Sequential holds a BatchNorm (any mode: its layers' modes live on other stages and may change
  between steps, while every stage must split alike). No warning: the argument is the choice.

In both modes :func:`refuse_sync_batch_norm` makes a ``SyncBatchNorm`` in training mode whose process
group is every rank (its default) raise at its forward: it would gather statistics from the ranks of
the other stages, which run other layers (a hang or a mismatch on GPUs; issue 40).

Evaluation steps, and models without BatchNorm (``GroupNorm``, ``LayerNorm``), split as before.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_gpipe._compat import BatchNormBase
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PipelineUsageError, check_choice

__all__ = [
    "BATCH_NORM_MODES",
    "batch_norms",
    "check_batch_norm",
    "keep_two_samples",
    "refusals",
    "refuse_sync_batch_norm",
    "refuse_training_batch_norm",
    "refusal_message",
    "sync_refusal_message",
]

_MODES = {
    "batch": (
        "training BatchNorm as on one device: refused when a step is split into more than one micro-batch"
    ),
    "micro_batch": "each micro-batch normalized by its own statistics, as GPipe defines it",
}
BATCH_NORM_MODES = tuple(_MODES)


def check_batch_norm(value: object) -> str:
    """Return ``value`` if it is one of :data:`BATCH_NORM_MODES` (``GPipeStrategy(batch_norm=...)``).

    Raises:
        ValueError: any other value, named, with the two choices.
    """
    return check_choice("batch_norm", value, _MODES)


def batch_norms(seq: nn.Module) -> list[str]:
    """Names (in ``seq``) of its BatchNorm layers: ``BatchNorm1d/2d/3d``, lazy, sync and deferred ones."""
    return [name for name, m in seq.named_modules() if isinstance(m, BatchNormBase)]


def keep_two_samples(stage: PipelineStage, names: list[str]) -> None:
    """Make ``stage`` keep 2 samples or more in each training micro-batch if the whole Sequential
    holds BatchNorm layers (``names``: :func:`batch_norms` of it, before the cut): ``"micro_batch"``.

    Args:
        stage: this rank's stage (its executor and the one-call-per-micro-batch split read the floor).
        names: the whole Sequential's BatchNorm layers.
    """
    if names:
        stage.executor.min_micro_batch = 2


def refusals(stage: PipelineStage, prefix: str, chunks: int, mode: str) -> list[RemovableHandle]:
    """The forward pre-hooks ``GPipeStrategy(batch_norm=mode)`` puts on the BatchNorm layers of ``stage``:
    :func:`refuse_sync_batch_norm` always, then :func:`refuse_training_batch_norm` under ``"batch"``;
    their handles, which the strategy removes when it puts the user's Sequential back."""
    handles = refuse_sync_batch_norm(stage, prefix)
    if mode == "batch":
        handles += refuse_training_batch_norm(stage, prefix, chunks)
    return handles


def refuse_sync_batch_norm(stage: PipelineStage, prefix: str) -> list[RemovableHandle]:
    """Make each ``nn.SyncBatchNorm`` of ``stage`` raise at a forward in training mode while its process
    group is every rank of an initialized job of 2 or more (``process_group=None``, as
    ``convert_sync_batchnorm`` leaves it); return the hooks' handles.

    Such a layer all-gathers its statistics over every rank at each forward, while the other stages'
    ranks run other layers: a hang until the collective timeout, or statistics mixed across layers
    when each stage holds one (GPUs; on CPU it raises that it needs a GPU). In eval mode it does not
    synchronize and runs as a BatchNorm.

    Raises (at that forward):
        PipelineUsageError: naming the layer, its stage and the fixes.
    """
    handles = []
    for name, module in stage.named_modules():
        if isinstance(module, nn.SyncBatchNorm):
            refuse = _sync_refusal(stage, prefix + name)
            handles.append(module.register_forward_pre_hook(refuse))
    return handles


def _sync_refusal(stage: PipelineStage, name: str) -> Any:
    """The forward pre-hook of SyncBatchNorm ``name``: raises where :func:`refuse_sync_batch_norm` says."""

    def refuse(module: nn.Module, args: Any) -> None:
        if module.training and module.process_group is None and _several_ranks():
            raise PipelineUsageError(sync_refusal_message(name, stage.topology.stage))

    return refuse


def _several_ranks() -> bool:
    """Whether this process is one of 2 or more ranks of an initialized job."""
    return dist.is_initialized() and dist.get_world_size() > 1


def sync_refusal_message(name: str, stage: int) -> str:
    """The error a training-mode ``SyncBatchNorm`` ``name`` (on ``stage``) meets in a pipeline."""
    return (
        f"SyncBatchNorm layer {name!r} (stage {stage}) runs in training mode: it would gather batch "
        "statistics from every rank, but the ranks of the other stages run other layers (a hang or "
        "wrong statistics). Use nn.BatchNorm1d/2d/3d in its place (do not call "
        "nn.SyncBatchNorm.convert_sync_batchnorm; for the whole batch's running statistics use "
        "GPipeStrategy(deferred_batch_norm=True) with batch_norm='micro_batch'), or put it in eval "
        "mode (frozen)"
    )


def refuse_training_batch_norm(stage: PipelineStage, prefix: str, chunks: int) -> list[RemovableHandle]:
    """Make each BatchNorm of ``stage`` raise at a forward in training mode inside a training step
    split into more than one micro-batch (``batch_norm="batch"``); return the hooks' handles, which
    the strategy removes when it puts the user's Sequential back.

    Args:
        stage: this rank's stage.
        prefix: what the user's names of the stage's layers start with (``"layers."``).
        chunks: micro-batches per mini-batch M asked for (``GPipeStrategy.chunks_used``), named in the error.

    Raises (at that forward):
        PipelineUsageError: naming the layer, its stage, M and the fixes.
    """
    handles = []
    for name, module in stage.named_modules():
        if isinstance(module, BatchNormBase):
            refuse = _refusal(stage, prefix + name, chunks)
            handles.append(module.register_forward_pre_hook(refuse))
    return handles


def _refusal(stage: PipelineStage, name: str, chunks: int) -> Any:
    """The forward pre-hook of BatchNorm ``name``: raises where :func:`refuse_training_batch_norm` says.

    A plain function (not a ``partial``): a deep copy of the module (a callback's) keeps it as it is.
    """

    def refuse(module: nn.Module, args: Any) -> None:
        m = stage.training_micro_batches
        if module.training and m > 1:
            deferred = isinstance(module, DeferredBatchNorm)
            raise PipelineUsageError(refusal_message(name, stage.topology.stage, m, chunks, deferred))

    return refuse


def refusal_message(name: str, stage: int, m: int, chunks: int, deferred: bool = False) -> str:
    """The error a training-mode BatchNorm ``name`` (on ``stage``) meets under ``m`` > 1 micro-batches of
    a step (``chunks``: asked for) with ``batch_norm="batch"``; ``deferred``: the layer is the
    :class:`~lightning_gpipe.engine.batchnorm.DeferredBatchNorm` of ``deferred_batch_norm=True``, which
    code freezing ``nn.BatchNorm2d`` layers by ``isinstance`` misses (said at the end)."""
    missed = (
        ". Under deferred_batch_norm=True it is a DeferredBatchNorm, not an nn.BatchNorm1d/2d/3d: to freeze "
        "it test isinstance(m, nn.modules.batchnorm._BatchNorm)"
    )
    return (
        f"BatchNorm layer {name!r} (stage {stage}) runs in training mode on a step split into {m} "
        f"micro-batches (chunks={chunks}): each micro-batch would be normalized by its own mean and "
        "variance, not by the whole batch's as on one device, so the losses and weights would differ "
        "from one device's. Use chunks=1 (whole-batch statistics, as on one device), or GroupNorm or "
        "LayerNorm in place of BatchNorm (they do not depend on the split), or "
        "GPipeStrategy(batch_norm='micro_batch') to accept GPipe's per-micro-batch statistics (then "
        "also deferred_batch_norm=True for the whole batch's running statistics). BatchNorm layers in "
        "eval mode (frozen) train under any chunks" + (missed if deferred else "")
    )
