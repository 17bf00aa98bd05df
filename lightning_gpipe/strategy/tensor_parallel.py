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
process starts (:func:`check_model`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.engine.stage import PipelineStage

__all__ = ["HOOK", "check_model", "parallelize", "unparallelize"]

_ADDED: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, set[int], set[int]]]]
_ADDED = weakref.WeakKeyDictionary()  # per stage: (module, pre-hook ids, hook ids) its plan added

HOOK = "parallelize_stage"
"""The LightningModule method that applies the user's tensor-parallel plan to one stage."""


def check_model(model: nn.Module, tensor_parallel_size: int) -> None:
    """Raise if ``tensor_parallel_size`` > 1 and ``model`` has no :data:`HOOK` method.

    Raises:
        ValueError: the message names the size and shows the hook to write.
    """
    if tensor_parallel_size > 1 and not callable(getattr(model, HOOK, None)):
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
    before = {m: (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in stage.modules()}
    getattr(model, HOOK)(stage, tp_mesh)
    stage.executor.tensor_mesh = tp_mesh
    _ADDED[stage] = [  # what the plan added: taken off with the plan at the end of fit
        (m, set(m._forward_pre_hooks) - pre, set(m._forward_hooks) - post)
        for m, (pre, post) in before.items()
    ]


def unparallelize(stage: PipelineStage) -> None:
    """Take the plan off ``stage``'s layers: every ``DTensor`` parameter becomes a plain parameter of its
    global shape (uninitialized: the gathered state is loaded into it next,
    :meth:`lightning_gpipe.strategy.pipelined.Pipelined.uninstall`) and the forward hooks the plan added are
    removed, so that the user's Sequential runs on one device after fit. Nothing without a plan."""
    for module, pre, post in _ADDED.pop(stage, ()):
        for key in pre:
            del module._forward_pre_hooks[key]
        for key in post:
            del module._forward_hooks[key]
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                plain = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
                setattr(module, name, nn.Parameter(plain, requires_grad=p.requires_grad))
