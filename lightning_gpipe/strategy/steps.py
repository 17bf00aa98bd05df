"""The step hooks' work: Lightning's training, validation, test and predict steps and the backward drain.

Under Lightning's automatic optimization, ``training_step`` runs the user's step, whose call of
the pipelined Sequential is the forward fill (:mod:`lightning_gpipe.engine.stage`), then the step outcome
(:mod:`lightning_gpipe.engine.outcome`); ``backward`` runs the user's loss backward on the last stage
(the strategy's precision plugin), then :func:`drain` on every stage: the stage's backward drain
and, once per optimizer step, the gradients' synchronization (:mod:`lightning_gpipe.strategy.gradients`).
:class:`~lightning_gpipe.strategy.strategy.GPipeStrategy`'s step hooks delegate here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_gpipe import _lightning
from lightning_gpipe.engine.batchnorm import commit_deferred_batch_norm
from lightning_gpipe.engine.stage import StageDone
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.strategy.gradients import synchronize_gradients
from lightning_gpipe.strategy.loss_graph import check_loss_graph
from lightning_gpipe.strategy.microstep import MicroSteps
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.tools.timeline import Timeline

__all__ = [
    "accumulating",
    "check_aux_with_num_items",
    "drain",
    "eval_step",
    "predict_step",
    "training_step",
]


def training_step(
    pipelined: Pipelined,
    run: Callable[..., Any],
    module: pl.LightningModule,
    deferred_batch_norm: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``run(*args, **kwargs)`` (the user's step over the stage ``pipelined`` holds:
    :meth:`.PipelineStage.run_step`, or :meth:`.MicroSteps.training_step` for one call per micro-batch),
    then the step outcome; on the last stage, the loss's graph checked first (:func:`.check_loss_graph`).

    ``deferred_batch_norm``: commit deferred BatchNorm statistics once per mini-batch
    (:mod:`lightning_gpipe.engine.batchnorm`).
    """
    stage = pipelined.running
    out = run(*args, **kwargs)
    if deferred_batch_norm:
        commit_deferred_batch_norm(stage)  # once per mini-batch, after all its micro-batches
    if not stage.ran_forward:
        pipelined.refuse_uncalled(out)
        return out
    if stage.topology.is_last:  # before any backward: the loss reaches the stage only through the call
        loss = out.get("loss") if isinstance(out, dict) else out
        if torch.is_tensor(loss):  # per micro-batch (lightning_gpipe.strategy.microstep): checked per call
            check_loss_graph(loss, stage.output_leaves(), module)
    return stage.share_outcome(out, _lightning.attached_trainer(module), training=True)


def eval_step(
    pipelined: Pipelined, hook: Callable[..., Any], module: pl.LightningModule, *args: Any, **kwargs: Any
) -> Any:
    """The ``validation_step``/``test_step`` hook over the stage of ``pipelined``, then the step outcome."""
    stage = pipelined.running
    out = _none_if_done(stage.run_step(hook, False, *args, **kwargs))
    if not stage.ran_forward:
        return out
    return stage.share_outcome(out, _lightning.attached_trainer(module), training=False)


def predict_step(
    pipelined: Pipelined,
    hook: Callable[..., Any],
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
    out = _none_if_done(pipelined.running.run_step(hook, False, *args, **kwargs))
    if _lightning.attached_trainer(module) is None or not module.trainer.predict_loop.return_predictions:
        return out
    return from_last_stage(out)


def drain(
    pipelined: Pipelined,
    micro_steps: MicroSteps | None,
    module: pl.LightningModule | None,
    data: torch.distributed.ProcessGroup | None,
    replicas: int,
    timeline: Timeline | None,
) -> None:
    """After the user's loss backward: the backward drain of the stage ``pipelined`` holds; once per optimizer
    step, the gradients synchronized over tied copies and the data-parallel ``replicas`` (group ``data``;
    a sharded stage's are reduce-scattered by FSDP, :mod:`.sharding`).

    ``micro_steps``: the gradients its calls made join the parameters' (``None``: one call per batch);
    ``timeline`` ends the step (``None``: no recording).
    """
    stage = pipelined.running
    if micro_steps is None:
        stage.backward()
    else:
        micro_steps.finish(stage.backward)  # the weight passes the last stage held for the drain
        check_aux_with_num_items(stage.executor.declared_aux, stage.step_gradient_scale)
        micro_steps.deposit(stage.step_gradient_scale)  # the gradients the step's micro-batch calls made
    if not accumulating(module):  # once per optimizer step, before clipping and the step
        replicas = replicas if pipelined.sharded is None else 1  # FSDP reduce-scatters them itself
        synchronize_gradients(stage.parameters(), pipelined.tied_groups, data, replicas)
    if timeline is not None:
        timeline.end_step()


def check_aux_with_num_items(declared_aux: bool, gradient_scale: float) -> None:
    """Raise if the step's gradients take a token-count factor (``num_items``) while this stage's layers
    declared aux losses, whose gradients the factor would rescale too.

    Raises:
        PipelineUsageError: both, naming the ways out.
    """
    if declared_aux and gradient_scale != 1.0:
        raise PipelineUsageError(
            "training_step returns num_items while layers declare aux losses (lightning_gpipe.aux_loss): "
            "under a per-micro-batch schedule the step's gradients are rescaled by the token count "
            "(M * k_ref / K, docs/lightning.md), which would rescale the aux losses' gradients too; return "
            "the loss without num_items, or use schedule='gpipe', where num_items changes nothing"
        )


def accumulating(module: pl.LightningModule | None) -> bool:
    """Whether this backward is followed by another before the optimizer step (gradient accumulation)."""
    if module is None or not module.automatic_optimization or _lightning.attached_trainer(module) is None:
        return False
    return _lightning.should_accumulate(module.trainer)


def _none_if_done(out: Any) -> Any:
    return None if out is StageDone else out
