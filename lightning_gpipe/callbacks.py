"""Lightning's callbacks that see the whole model, adapted to a process that holds one stage.

Lightning's callbacks run on every rank; some of them read or copy the LightningModule and would
see only this rank's stage. After the strategy cuts the model (:meth:`GPipeStrategy.setup`),
:func:`adapt_callbacks` adjusts each kind once:

- **copies of the module** (``StochasticWeightAveraging``'s ``deepcopy`` and ``WeightAveraging`` /
  ``EMAWeightAveraging``'s ``AveragedModel``, made in ``setup`` before the cut, and any other
  callback attribute holding a copy of the module): the copy's Sequential is cut like the live
  one, so each stage averages its own parameters. The averaged weights equal one device's.
- **summaries** (``ModelSummary``, ``RichModelSummary``): summarize the whole model (every
  stage's layers, the whole parameter count), without calling it on ``example_input_array``
  (the in/out sizes columns are left out; calling the model there would run the whole model on
  one device).
- **throughput** (``ThroughputMonitor``): its world size is the number of pipelines D, not the
  process count: every stage of a pipeline sees the same samples, which count once.
- **prediction writers** (``BasePredictionWriter``): write on the ranks that hold predictions
  (each pipeline's last stage, one per data-parallel replica) and not on the other stages.

:func:`restore_callbacks` undoes the per-instance changes at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytorch_lightning as pl
from torch import nn

from lightning_gpipe._compat import example_input_slot, set_example_input_slot, throughputs
from lightning_gpipe._namespace import lightning_class

_PATCHED = "_gpipe_patched"  # names of the instance attributes set on a callback, to remove at teardown


def _is(callback: Any, klass: type, namespace: str) -> bool:
    return isinstance(callback, lightning_class(klass, namespace))


def _patch(callback: Any, name: str, value: Any) -> None:
    callback.__dict__[name] = value
    callback.__dict__.setdefault(_PATCHED, []).append(name)


def module_copies(callback: Any, module: nn.Module) -> Iterator[nn.Module]:
    """Copies of ``module`` (same class, another object) anywhere in ``callback``'s module attributes."""
    for value in vars(callback).values():
        if isinstance(value, nn.Module) and value is not module:
            for inner in value.modules():
                if type(inner) is type(module) and inner is not module:
                    yield inner


def adapt_callbacks(
    trainer: pl.Trainer,
    module: nn.Module,
    namespace: str,
    seq_name: str,
    cut_copy: Callable[[nn.Sequential], nn.Module],
    replicas: int,
    holds_predictions: bool,
    whole_model: Callable[[], AbstractContextManager[Any]],
) -> None:
    """Adjust ``trainer``'s callbacks to this rank's stage (see the module docstring).

    Args:
        trainer: the Trainer (either namespace).
        module: the LightningModule, already cut.
        namespace: the Trainer's namespace (``"pytorch_lightning"`` or ``"lightning"``).
        seq_name: attribute path of the pipelined Sequential in ``module``.
        cut_copy: the Sequential of a copy of ``module`` → this stage's part of it.
        replicas: data-parallel pipelines D.
        holds_predictions: whether this rank is a last stage.
        whole_model: a context in which ``module`` holds its whole Sequential again.
    """
    callbacks = pl.callbacks
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        for copy in module_copies(callback, module):
            parent_name, _, attr = seq_name.rpartition(".")
            parent = copy.get_submodule(parent_name) if parent_name else copy
            seq = getattr(parent, attr)
            if isinstance(seq, nn.Sequential):
                setattr(parent, attr, cut_copy(seq))
        if _is(callback, callbacks.ThroughputMonitor, namespace):
            for throughput in throughputs(callback):
                throughput.world_size = replicas
        if _is(callback, callbacks.ModelSummary, namespace) and _PATCHED not in vars(callback):
            _patch(callback, "on_fit_start", _on_whole_model(callback.on_fit_start, whole_model))
        if _is(callback, callbacks.BasePredictionWriter, namespace) and not holds_predictions:
            _patch(callback, "write_on_batch_end", _skip)
            _patch(callback, "write_on_epoch_end", _skip)


def restore_callbacks(trainer: Any) -> None:
    """Remove what :func:`adapt_callbacks` set on callback instances."""
    for callback in getattr(trainer, "callbacks", ()):
        for name in vars(callback).pop(_PATCHED, []):
            vars(callback).pop(name, None)


def _skip(*args: Any, **kwargs: Any) -> None:
    """A prediction writer on a stage without predictions writes nothing."""


def _on_whole_model(hook: Callable[..., Any], whole_model: Callable[[], AbstractContextManager[Any]]) -> Any:
    """``hook(trainer, pl_module)`` run while the module holds its whole Sequential, not called on its example input."""

    def run_on_whole_model(trainer: Any, pl_module: Any) -> Any:
        example = example_input_slot(pl_module)
        set_example_input_slot(pl_module, None)  # the whole model is not called on this rank
        try:
            with whole_model():
                return hook(trainer, pl_module)
        finally:
            set_example_input_slot(pl_module, example)

    return run_on_whole_model
