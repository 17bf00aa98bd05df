"""The module's epoch-end hooks on stages that hold no step outputs: the last stage's hook decides.

A step method's code after the pipelined call (the loss, ``self.log``, what it appends to a list)
runs on the last stage only. A LightningModule that collects its step outputs for an epoch-end hook,
as Lightning 2's migration guide shows (``self.validation_step_outputs.append(loss)`` in
``validation_step``, ``torch.stack(self.validation_step_outputs).mean()`` in
``on_validation_epoch_end``), has them on the last stage only: on the other stages the list is empty
and the hook may raise. What Lightning reads of those hooks, the values they log, comes from the
last stage already (:mod:`lightning_gpipe.strategy.metrics`: the other stages' logging is dropped,
and the last stage's ``callback_metrics`` reach them after the hook).

The rule: on a stage other than the last, an ``Exception`` that the module's ``on_train_epoch_end``,
``on_validation_epoch_end`` or ``on_test_epoch_end`` raises is held until the share of the last
stage's metrics that follows the hook (right after ``on_train_epoch_end``, at ``on_validation_end``
/ ``on_test_end``). Where that share arrives, the last stage ran the same hook without error: the
exception is dropped, with a warning once per hook. Where the last stage failed (the share raises,
naming its error), this stage raises its own exception, from the share's. An exception the last
stage raises is never held, nor one raised by a callback. The rest of a hook that raised does not run
on that stage; the warning says so (code past the failing line that steps a scheduler or changes the
module belongs behind ``self.trainer.strategy.is_last_stage`` or before the step outputs are read).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["EPOCH_END_HOOKS", "guard_epoch_end_hooks", "resolve_held", "unguard_epoch_end_hooks"]

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")
_warned: set[str] = set()  # hooks already warned about in this process


def guard_epoch_end_hooks(
    module: Any, last_stage: bool, share: Callable[[], None], held: dict[str, Any]
) -> None:
    """Wrap ``module``'s epoch-end hooks (on the instance; :func:`unguard_epoch_end_hooks` removes them).

    ``on_train_epoch_end`` calls ``share()`` after the user's code on every stage (Lightning's monitoring
    callbacks and plateau schedulers, which run next, read what it logs). On a stage other than the last
    (not ``last_stage``) each hook's ``Exception`` is put in ``held`` (hook name -> exception), to be
    resolved by the share that follows (:func:`resolve_held`). A hook already set on the instance is
    left alone.
    """
    if module is None:
        return
    for name in EPOCH_END_HOOKS:
        if name in vars(module):
            continue
        hook = getattr(module, name)
        vars(module)[name] = _guarded(name, hook, last_stage, held)
    train_hook = vars(module).get("on_train_epoch_end")
    if train_hook is not None and getattr(train_hook, "gpipe_guard", False):
        vars(module)["on_train_epoch_end"] = _sharing(train_hook, share, held)


def _guarded(name: str, hook: Callable[[], Any], last_stage: bool, held: dict[str, Any]) -> Callable[[], Any]:
    def guarded() -> Any:
        if last_stage:
            return hook()
        try:
            return hook()
        except Exception as err:  # noqa: BLE001 - held until the last stage's outcome is known
            held[name] = err
            return None

    guarded.gpipe_guard = True  # type: ignore[attr-defined]
    return guarded


def _sharing(hook: Callable[[], Any], share: Callable[[], None], held: dict[str, Any]) -> Callable[[], Any]:
    def on_train_epoch_end() -> None:
        hook()
        resolve_held(share, held)

    on_train_epoch_end.gpipe_guard = True  # type: ignore[attr-defined]
    return on_train_epoch_end


def resolve_held(share: Callable[[], None], held: dict[str, Any]) -> None:
    """Run ``share()`` (every stage of the pipeline joins it), then settle the exceptions ``held``: where
    the share raises (the last stage failed), raise the first held exception from it; where it arrives,
    drop them with a warning once per hook.

    Raises:
        Exception: the held exception, or the share's own where none is held.
    """
    try:
        share()
    except Exception as failed:
        if held:
            _, err = next(iter(held.items()))
            held.clear()
            raise err from failed
        raise
    for name, err in list(held.items()):
        held.pop(name)
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"{name} raised {type(err).__name__}: {err} on a stage other than the last, where a step "
                "method's code after the pipelined call does not run (a list of step outputs it reads is "
                f"empty there); the last stage's {name} ran without error and what it logs stands for every "
                "stage, so the error is ignored here. The rest of the hook did not run on this stage: where "
                "it does more than compute and log values (steps a scheduler, changes the module), run the "
                "part that reads step outputs only where self.trainer.strategy.is_last_stage",
                stacklevel=2,
            )


def unguard_epoch_end_hooks(module: Any) -> None:
    """Undo :func:`guard_epoch_end_hooks` on ``module``."""
    if module is None:
        return
    for name in EPOCH_END_HOOKS:
        if getattr(vars(module).get(name), "gpipe_guard", False):
            vars(module).pop(name)
