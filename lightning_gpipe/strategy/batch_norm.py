"""BatchNorm under micro-batches: never a micro-batch of one sample, and GPipe's statistics said plainly.

In training a BatchNorm normalizes its input by the input's own mean and variance. The pipeline
runs each layer on one micro-batch at a time, so each micro-batch is normalized by its own
statistics (GPipe, Huang et al. 2019, section 2.2): with M > 1 micro-batches the step differs
from the same model on the whole batch, and a micro-batch of one sample breaks it
(``BatchNorm1d`` raises "Expected more than 1 value per channel when training", a ``BatchNorm2d``
normalizes each image by itself) where one device trains (issue 40, kind E).

:func:`keep_two_samples` therefore makes the stage split a training batch of N samples into at
most ``N // 2`` micro-batches when the whole Sequential holds a BatchNorm (any mode: its layers'
modes live on other stages and may change between steps, while every stage must split alike), and
warns once that each micro-batch is normalized by its own statistics. Evaluation steps, and models
without BatchNorm (``GroupNorm``, ``LayerNorm``), split as before.
"""

from __future__ import annotations

from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_gpipe._compat import BatchNormBase
from lightning_gpipe.engine.stage import PipelineStage

__all__ = ["batch_norms", "keep_two_samples"]


def batch_norms(seq: nn.Module) -> list[str]:
    """Names (in ``seq``) of its BatchNorm layers: ``BatchNorm1d/2d/3d``, lazy, sync and deferred ones."""
    return [name for name, m in seq.named_modules() if isinstance(m, BatchNormBase)]


def keep_two_samples(stage: PipelineStage, names: list[str], chunks: int) -> None:
    """Make ``stage`` keep 2 samples or more in each training micro-batch if the whole Sequential
    holds BatchNorm layers (``names``: :func:`batch_norms` of it, before the cut), and warn (once, on
    rank 0) when ``chunks`` (M) > 1 splits its batches.

    Args:
        stage: this rank's stage (its executor and the one-call-per-micro-batch split read the floor).
        names: the whole Sequential's BatchNorm layers.
        chunks: micro-batches per mini-batch M.
    """
    if not names:
        return
    stage.executor.min_micro_batch = 2
    if chunks > 1:
        rank_zero_warn(
            f"the pipelined Sequential holds BatchNorm layers ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): in training each of the {chunks} micro-batches is "
            "normalized by its own mean and variance (GPipe's semantics), not by the whole batch's as on "
            "one device, so the losses and weights differ from one device's; a batch of N is split into "
            "at most N // 2 micro-batches so that none holds one sample. chunks=1 trains as one device "
            "does; GroupNorm or LayerNorm do not depend on the split; deferred_batch_norm=True makes the "
            "running statistics the whole batch's"
        )
