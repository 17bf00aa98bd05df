"""The step hooks' work: Lightning's training, validation, test and predict steps and the backward drain.

Under Lightning's automatic optimization, ``training_step`` runs the user's step, whose call of
the pipelined Sequential is the forward fill (:mod:`lightning_gpipe.engine.stage`), then the step outcome
(:mod:`lightning_gpipe.engine.outcome`); ``backward`` runs the user's loss backward on the last stage
(the strategy's precision plugin), then :meth:`StepDriver.drain` on every stage: the stage's
backward drain and, once per optimizer step, the gradients' synchronization
(:mod:`lightning_gpipe.strategy.gradients`). :class:`~lightning_gpipe.strategy.strategy.GPipeStrategy`'s step
hooks delegate here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import Precision

from lightning_gpipe import _lightning
from lightning_gpipe.engine.batchnorm import commit_deferred_batch_norm
from lightning_gpipe.engine.stage import PipelineStage, StageDone
from lightning_gpipe.strategy.gradients import synchronize_gradients
from lightning_gpipe.strategy.microstep import MicroSteps
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.tools.timeline import Timeline

__all__ = ["StepDriver", "accumulating"]


class StepDriver:
    """What the strategy's step hooks do, over the stage ``pipelined`` holds from setup to teardown.

    Args:
        pipelined: this rank's stage in the user's module (:class:`~lightning_gpipe.strategy.pipelined.Pipelined`).
        micro_steps: ``training_step`` once per micro-batch (every schedule but ``"gpipe"``,
            :mod:`lightning_gpipe.strategy.microstep`), or ``None``: once per mini-batch.
        deferred_batch_norm: commit deferred BatchNorm statistics once per mini-batch
            (:mod:`lightning_gpipe.engine.batchnorm`).
    """

    def __init__(
        self, pipelined: Pipelined, micro_steps: MicroSteps | None, deferred_batch_norm: bool
    ) -> None:
        self.pipelined = pipelined
        self.micro_steps = micro_steps
        self.deferred_batch_norm = deferred_batch_norm

    @property
    def stage(self) -> PipelineStage:
        assert self.pipelined.stage is not None, "the stage exists from setup to teardown"
        return self.pipelined.stage

    def training_step(
        self,
        step: Callable[..., Any],
        module: pl.LightningModule,
        precision_plugin: Precision,
        chunks: int,
        timeline: Timeline | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Lightning's ``training_step`` hook ``step`` (the user's step) over the stage, then the step outcome.

        ``chunks`` is M (one call per micro-batch splits the batch into M); ``timeline`` records
        the step (``None``: no recording).
        """
        if timeline is not None:
            timeline.begin_step(module.trainer.global_step)
        stage = self.stage
        if (
            self.micro_steps is not None
        ):  # one training_step per micro-batch (lightning_gpipe.strategy.microstep)
            out = self.micro_steps.training_step(
                step, stage, module, precision_plugin, chunks, *args, **kwargs
            )
        else:
            out = stage.run_step(step, True, *args, **kwargs)
        if self.deferred_batch_norm:
            commit_deferred_batch_norm(stage)  # once per mini-batch, after all its micro-batches
        if not stage.ran_forward:
            self.pipelined.refuse_uncalled(out)
            return out
        return stage.share_outcome(out, _lightning.attached_trainer(module), training=True)

    def eval_step(self, hook: Any, module: pl.LightningModule, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``validation_step``/``test_step`` hook over the stage, then the step outcome."""
        out = _none_if_done(self.stage.run_step(hook, False, *args, **kwargs))
        if not self.stage.ran_forward:
            return out
        return self.stage.share_outcome(out, _lightning.attached_trainer(module), training=False)

    def predict_step(
        self,
        hook: Any,
        module: pl.LightningModule,
        from_last_stage: Callable[[Any], Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """The last stage's predictions, on every stage of its pipeline (as each DDP rank holds its own).

        ``trainer.predict`` then returns, on every rank, the predictions of its pipeline's data
        shard (D = 1: all of them), so ``torch.cat(trainer.predict(...))`` works everywhere.
        Prediction writers run only on last stages (:mod:`lightning_gpipe.strategy.callbacks`), so each
        prediction is written once per replica. With ``return_predictions=False`` nothing is sent.
        """
        out = _none_if_done(self.stage.run_step(hook, False, *args, **kwargs))
        if _lightning.attached_trainer(module) is None or not module.trainer.predict_loop.return_predictions:
            return out
        return from_last_stage(out)

    def drain(
        self,
        module: pl.LightningModule | None,
        data: torch.distributed.ProcessGroup | None,
        replicas: int,
        timeline: Timeline | None,
    ) -> None:
        """After the user's loss backward: every stage's backward drain; once per optimizer step, the
        gradients synchronized over tied copies and the ``replicas`` data-parallel replicas (group ``data``)."""
        self.stage.backward()
        if self.micro_steps is not None:
            self.micro_steps.deposit()  # the gradients the step's micro-batch calls made
        if not accumulating(module):  # once per optimizer step, before clipping and the step
            synchronize_gradients(self.stage.parameters(), self.pipelined.tied_groups, data, replicas)
        if timeline is not None:
            timeline.end_step()


def accumulating(module: pl.LightningModule | None) -> bool:
    """Whether this backward is followed by another before the optimizer step (gradient accumulation)."""
    if module is None or not module.automatic_optimization or _lightning.attached_trainer(module) is None:
        return False
    return _lightning.should_accumulate(module.trainer)


def _none_if_done(out: Any) -> Any:
    return None if out is StageDone else out
