"""Tensor parallelism by the user's plan: the LightningModule's ``parallelize_stage`` hook, run on each
rank's stage after the cut (issue 42, item 3).

With ``GPipeStrategy(tensor_parallel_size=T)``, T > 1, every stage runs on T adjacent ranks
(:class:`~lightning_gpipe.transport.layout.Layout`). Once the Sequential is cut, the stage placed and its
weights equal on every replica and tensor-parallel rank, the strategy calls::

    module.parallelize_stage(stage, device_mesh["tensor_parallel"])

``stage`` is this rank's ``nn.Sequential`` of its layers under their names in the user's Sequential (or
plan), and the mesh is the 1-D ``tensor_parallel`` slice of ``self.device_mesh``: the hook applies
``torch.distributed.tensor.parallel.parallelize_module`` to the stage's layers, as Lightning's
``ModelParallelStrategy`` users do to their model in ``configure_model``. It runs before the optimizers
are made, so they hold the ``DTensor`` parameters. A model without the hook is refused before any
process starts (:func:`check_model`). A hook that raises, or that parallelizes a module outside the stage (a
part on another stage, an attribute the stage does not hold), is refused with the rank's layers and the
fix named (:func:`apply_plan`).

Every other feature runs on the mesh (issue 42, item 4): a model built on the meta device materializes
its stage on each rank before the plan shards it; parameters tied across stages are re-bound to the
plan's ``DTensor`` parameters and their gradients summed whole (:func:`lightning_gpipe.partition.tied.
sum_tied_gradients`); the gradient hooks see the whole model, ``DTensor`` parameters as whole copies
(:mod:`lightning_gpipe.strategy.whole_model`); a sharded checkpoint loads into any (K, D, T) layout.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PipelineUsageError

__all__ = ["HOOK", "apply_plan", "check_model", "parallelize", "unparallelize"]

_ADDED: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, set[int], set[int]]]]
_ADDED = weakref.WeakKeyDictionary()  # per stage: (module, pre-hook ids, hook ids) its plan added

HOOK = "parallelize_stage"
"""The LightningModule method that applies the user's tensor-parallel plan to one stage."""


def check_model(model: nn.Module, tensor_parallel_size: int) -> None:
    """Raise if ``tensor_parallel_size`` > 1 and ``model`` has no :data:`HOOK` method, or one that cannot
    be called with ``(stage, tp_mesh)``.

    Raises:
        ValueError: the message names the size (or the hook's signature) and shows the hook to write.
    """
    hook = getattr(model, HOOK, None)
    if tensor_parallel_size > 1 and callable(hook):
        try:
            inspect.signature(hook).bind(None, None)
        except TypeError:
            raise ValueError(
                f"{type(model).__name__}.{HOOK}{inspect.signature(hook)} cannot be called as "
                f"{HOOK}(stage, tp_mesh): the strategy passes the rank's stage and the 1-D tensor-parallel "
                f"mesh; define it as def {HOOK}(self, stage, tp_mesh)"
            ) from None
    if tensor_parallel_size > 1 and not callable(hook):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs a tensor-parallel plan: "
            f"{type(model).__name__} has no {HOOK}(self, stage, tp_mesh) method. Define it to apply "
            "torch.distributed.tensor.parallel.parallelize_module to the stage's layers over tp_mesh "
            "(e.g. ColwiseParallel for attention q/k/v and the MLP's up/gate, RowwiseParallel for the "
            "attention output and the MLP's down projection), or set tensor_parallel_size=1"
        )


def parallelize(model: nn.Module, stage: PipelineStage, mesh: Any, tensor_parallel_size: int) -> None:
    """Run the user's :data:`HOOK` on ``stage`` over ``mesh["tensor_parallel"]`` (``mesh``: the strategy's
    device mesh); DTensors arriving from the previous stage are rebuilt on that mesh
    (:mod:`lightning_gpipe.engine.dtensor_wire`). Nothing with ``tensor_parallel_size`` 1."""
    if tensor_parallel_size <= 1:
        return
    check_model(model, tensor_parallel_size)
    tp_mesh = mesh["tensor_parallel"]
    _ADDED[stage] = apply_plan(model, stage, tp_mesh)
    stage.executor.tensor_mesh = tp_mesh


def apply_plan(
    model: nn.Module, stage: nn.Module, tp_mesh: Any
) -> list[tuple[nn.Module, set[int], set[int]]]:
    """Call ``model.parallelize_stage(stage, tp_mesh)`` and return what it added: per module of ``stage``,
    ``(module, forward pre-hook ids, forward hook ids)``.

    Warns when the stage holds no ``DTensor`` parameter after the hook (a plan whose names match none of
    the stage's modules): each tensor-parallel rank then computes the whole stage.

    Raises:
        PipelineUsageError: the hook raised (chained), or it parallelized a module of ``model`` outside
            ``stage`` (a ``DTensor`` parameter or a forward hook there); the message names the rank's
            layers and says to apply the plan to ``stage``'s layers, as the model's attributes hold only
            this stage's layers (a part on another stage is empty here).
    """
    inside = {id(m) for m in stage.modules()}
    modules = [*stage.modules(), *(m for m in model.modules() if id(m) not in inside)]
    before = {m: (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in modules}
    try:
        getattr(model, HOOK)(stage, tp_mesh)
    except Exception as err:
        raise PipelineUsageError(
            f"{type(model).__name__}.{HOOK}(stage, tp_mesh) raised {type(err).__name__}: {err}. "
            f"{_where(stage)}"
        ) from err
    touched = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if id(m) not in inside
        and (
            set(m._forward_pre_hooks) != before.get(m, (set(), set()))[0]
            or set(m._forward_hooks) != before.get(m, (set(), set()))[1]
            or any(isinstance(p, DTensor) for p in m.parameters(recurse=False))
        )
    ]
    if touched:
        raise PipelineUsageError(
            f"{type(model).__name__}.{HOOK}(stage, tp_mesh) parallelized {', '.join(touched)}, outside "
            f"this rank's stage. {_where(stage)}"
        )
    if not any(isinstance(p, DTensor) for p in stage.parameters()):
        layers = ", ".join(name for name, _ in stage.named_children()) or "none"
        warnings.warn(
            f"{type(model).__name__}.{HOOK}(stage, tp_mesh) left every parameter of this rank's stage "
            f"(layers {layers}) plain: each of its tensor-parallel ranks holds and computes the whole "
            "stage. Check the plan's module names against the stage's layers (parallelize_module warns "
            "of keys it cannot resolve)",
            stacklevel=2,
        )
    return [
        (m, set(m._forward_pre_hooks) - pre, set(m._forward_hooks) - post)
        for m, (pre, post) in before.items()
        if id(m) in inside
    ]


def _where(stage: nn.Module) -> str:
    """The rank's layers, and where the plan must go."""
    layers = ", ".join(name for name, _ in stage.named_children()) or "none"
    return (
        f"On this rank the stage holds the layers {layers}, and the model's attributes hold only these (a "
        "part on another stage is empty here): apply the plan to the stage's layers, e.g. for layer in "
        "stage.children(): if isinstance(layer, Block): parallelize_module(layer, tp_mesh, plan)"
    )


def unparallelize(stage: PipelineStage, whole: bool = False) -> None:
    """Take the plan off ``stage``'s layers: every ``DTensor`` parameter becomes a plain parameter of its
    global shape and the forward hooks the plan added are removed, so that the user's Sequential runs on one
    device after fit, and the next ``fit``, ``validate``, ``test`` or ``predict`` applies the plan again
    (``distribute_module`` refuses a module it has marked). Nothing without a plan.

    Args:
        whole: the plain parameters take the ``DTensor``'s whole value (``full_tensor()``: a collective of
            the stage's tensor-parallel ranks, every one calling this in the same order): a model built
            stage-only keeps its trained stage after fit. Otherwise they are left uninitialized, as the
            gathered state is loaded into them next (:meth:`lightning_gpipe.strategy.pipelined.Pipelined.
            uninstall`).
    """
    for module, pre, post in _ADDED.pop(stage, ()):
        module.__dict__.pop("_distribute_module_applied", None)  # torch's mark of a distributed module
        for key in pre:
            del module._forward_pre_hooks[key]
        for key in post:
            del module._forward_hooks[key]
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                if whole:
                    plain = p.full_tensor().detach()
                else:
                    plain = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
                setattr(module, name, nn.Parameter(plain, requires_grad=p.requires_grad))
