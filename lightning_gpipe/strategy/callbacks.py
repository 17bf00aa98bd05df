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
- **tuners** (``BatchSizeFinder``, ``LearningRateFinder``, and ``Tuner``'s ``scale_batch_size`` /
  ``lr_find``, which add them): refused with ``ValueError``, as Lightning refuses them under its
  own distributed strategies; they re-run ``fit`` from inside ``fit`` and decide from the loss,
  which only the last stage holds.
- **pruning** (``ModelPruning``, which lists the parameters to prune in ``setup``, before the
  cut): each stage prunes its own layers' parameters (the masks equal one device's); the lottery
  ticket's saved layers follow; a checkpoint made permanent keeps every stage's weights (the
  gathered ``state_dict``, not this stage's). With ``make_pruning_permanent=False`` the other
  stages' layers get the same re-parametrization (``weight_orig``, ``weight_mask``) before the
  whole Sequential is loaded at teardown. ``use_global_unstructured=True`` ranks the parameters
  of the whole model against each other, across stages: it raises ``ValueError`` when the
  parameters to prune span more than one stage.

:func:`restore_callbacks` undoes the per-instance changes at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl
from torch import nn
from torch.nn.utils import prune

from lightning_gpipe._lightning import example_input_slot, set_example_input_slot, throughputs
from lightning_gpipe.strategy._namespace import lightning_class
from lightning_gpipe.strategy.pipelined import Pipelined

_PATCHED = "_gpipe_patched"  # names of the instance attributes set on a callback, to remove at teardown


def refuse_with_shards(callback: Any, module: nn.Module, namespace: str) -> None:
    """Refuse a callback that cannot work on sharded stages (``data_parallel="fsdp"``, :mod:`.sharding`).

    Raises:
        ValueError: weight averaging (it keeps a plain copy of the model that the sharded parameters
            would be copied into) or ``ModelPruning`` (it re-parametrizes the parameters FSDP shards).
    """
    if next(module_copies(callback, module), None) is not None or _is(
        callback, pl.callbacks.ModelPruning, namespace
    ):
        raise ValueError(
            f"{type(callback).__name__} cannot run with data_parallel='fsdp': it keeps or re-parametrizes "
            "the model's parameters, which FSDP shards over the replicas; use data_parallel='replicate' "
            "with it, or leave the callback out"
        )


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
    pipelined: Pipelined,
    replicas: int,
    holds_predictions: bool,
) -> None:
    """Adjust ``trainer``'s callbacks to this rank's stage (see the module docstring).

    Args:
        trainer: the Trainer (either namespace).
        module: the LightningModule, already cut.
        namespace: the Trainer's namespace (``"pytorch_lightning"`` or ``"lightning"``).
        pipelined: this rank's stage in ``module``: the Sequential's name, a copy's cut
            (:meth:`.Pipelined.cut_copy`), the whole model again (:meth:`.Pipelined.whole_model`).
        replicas: data-parallel pipelines D.
        holds_predictions: whether this rank is a last stage.
    """
    seq_name, cut_copy, whole_model = pipelined.name or "", pipelined.cut_copy, pipelined.whole_model
    callbacks = pl.callbacks
    refuse_tuners(trainer.callbacks, namespace)  # type: ignore[attr-defined]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if pipelined.sharded is not None:
            refuse_with_shards(callback, module, namespace)
        for copy in module_copies(callback, module):
            parent_name, _, attr = seq_name.rpartition(".")
            parent = copy.get_submodule(parent_name) if parent_name else copy
            seq = getattr(parent, attr) if attr else None  # a plan on the model itself: no Sequential
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
        if _is(callback, callbacks.ModelPruning, namespace) and _PATCHED not in vars(callback):
            _prune_this_stage(callback, module)


def refuse_tuners(callbacks: Any, namespace: str) -> None:
    """Raise for a ``BatchSizeFinder`` or ``LearningRateFinder`` among ``callbacks``.

    Raises:
        ValueError: one of them is there (``Tuner.scale_batch_size`` / ``lr_find`` add them).
    """
    for callback in callbacks:
        for klass in (pl.callbacks.BatchSizeFinder, pl.callbacks.LearningRateFinder):
            if _is(callback, klass, namespace):
                raise ValueError(
                    f"{klass.__name__} is not supported under the gpipe strategy (callback: "
                    f"{type(callback).__name__}); as under Lightning's DDP/FSDP strategies, tune with a "
                    "one-device Trainer and pass the batch size or learning rate it found"
                )


def _prune_this_stage(callback: Any, module: nn.Module) -> None:
    """Keep, of the ``(layer, name)`` pairs ``ModelPruning`` chose in ``setup``, those of this stage.

    Raises:
        ValueError: ``use_global_unstructured=True`` and the parameters to prune span more than one stage.
    """
    here = {id(m) for m in module.modules()}
    pairs = list(callback._parameters_to_prune)
    kept = [i for i, (layer, _) in enumerate(pairs) if id(layer) in here]
    others = [pair for i, pair in enumerate(pairs) if i not in set(kept)]
    if others and callback._use_global_unstructured:
        raise ValueError(
            "ModelPruning(use_global_unstructured=True) ranks parameters across the whole model, "
            "which spans several pipeline stages "
            f"(this stage holds {len(kept)} of the {len(pairs)} parameters to prune); "
            "pass use_global_unstructured=False (each parameter pruned by its own ranking)"
        )
    index = {old: new for new, old in enumerate(kept)}
    callback._parameters_to_prune = [pairs[i] for i in kept]
    if callback._original_layers is not None:  # the lottery ticket's initial layers, by pair index
        layers = {}
        for key, ref in callback._original_layers.items():
            names = [(index[i], name) for i, name in ref["names"] if i in index]
            if names:
                layers[key] = dict(ref, names=names)
        callback._original_layers = layers
    _patch(callback, "_gpipe_other_stages", others)
    _patch(callback, "_gpipe_pruned", False)
    _patch(callback, "apply_pruning", _recording_pruning(callback, callback.apply_pruning))
    _patch(callback, "on_save_checkpoint", _permanent_on_gathered_state(callback))


def _recording_pruning(callback: Any, apply: Callable[[Any], None]) -> Callable[[Any], None]:
    def apply_and_record(amount: Any) -> None:
        apply(amount)
        vars(callback)["_gpipe_pruned"] = True

    return apply_and_record


def _permanent_on_gathered_state(callback: Any) -> Callable[[Any, Any, dict[str, Any]], None]:
    """``ModelPruning.on_save_checkpoint`` on the checkpoint's ``state_dict`` (every stage's, gathered on
    rank 0), not on this stage's module."""

    def on_save_checkpoint(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if callback._make_pruning_permanent:
            gathered = SimpleNamespace(state_dict=lambda: checkpoint["state_dict"])
            checkpoint["state_dict"] = callback._make_pruning_permanent_on_state_dict(gathered)

    return on_save_checkpoint


def _reparametrize_other_stages(callback: Any) -> None:
    """After pruning that is not made permanent: the other stages' layers take ``weight_orig`` and
    ``weight_mask`` too (identity pruning), so the whole Sequential loads every stage's state."""
    if not vars(callback).get("_gpipe_pruned") or callback._make_pruning_permanent:
        return
    for layer, name in vars(callback).get("_gpipe_other_stages", ()):
        if not hasattr(layer, name + "_orig"):
            prune.identity(layer, name)


def restore_callbacks(trainer: Any) -> None:
    """Remove what :func:`adapt_callbacks` set on callback instances."""
    for callback in getattr(trainer, "callbacks", ()):
        _reparametrize_other_stages(callback)
        for name in vars(callback).pop(_PATCHED, []):
            vars(callback).pop(name, None)


def _skip(*args: Any, **kwargs: Any) -> None:
    """A prediction writer on a stage without predictions writes nothing."""


def _on_whole_model(hook: Callable[..., Any], whole_model: Callable[[], AbstractContextManager[Any]]) -> Any:
    """``hook(trainer, pl_module)`` run while the module holds its whole Sequential, not called on its
    example input."""

    def run_on_whole_model(trainer: Any, pl_module: Any) -> Any:
        example = example_input_slot(pl_module)
        set_example_input_slot(pl_module, None)  # the whole model is not called on this rank
        try:
            with whole_model():
                return hook(trainer, pl_module)
        finally:
            set_example_input_slot(pl_module, example)

    return run_on_whole_model
