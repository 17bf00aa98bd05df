"""Every private Lightning and torch internal the package relies on, in one place.

Checked against torch 2.13.0, pytorch-lightning / lightning-fabric 2.6. Each entry is tested in
``tests/test_compat.py``, so that an upgrade that removes or renames one fails there, loudly,
naming the entry, rather than deep inside a multi-process run. Nothing else in the package
touches an underscored attribute of Lightning or torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.strategies import _StrategyRegistry as StrategyRegistry
from lightning_fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning_fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning_fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning_fabric.utilities.distributed import _sync_ddp as sync_ddp
from lightning_fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE
from lightning_fabric.utilities.optimizer import _optimizer_to_device as optimizer_to_device
from lightning_fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from pytorch_lightning.core.saving import _load_state
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from pytorch_lightning.utilities.migration.utils import _pl_migrate_checkpoint
from torch import nn
from torch._C._autograd import _enable_record_function
from torch._dynamo.eval_frame import OptimizedModule
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors
from torch.amp import GradScaler
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.optim import Optimizer
from torch.utils._pytree import TreeSpec
from torch.utils._pytree import keystr as _keystr
from torch.utils._pytree import tree_flatten as _tree_flatten
from torch.utils._pytree import tree_flatten_with_path as _tree_flatten_with_path
from torch.utils._pytree import tree_unflatten as _tree_unflatten

__all__ = [
    "BatchNormBase",
    "OVERRIDDEN",
    "StrategyRegistry",
    "IS_INTERACTIVE",
    "OptimizedModule",
    "compile_like",
    "compiled_module",
    "example_input_slot",
    "throughputs",
    "TreeSpec",
    "tree_flatten",
    "tree_leaf_paths",
    "tree_unflatten",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "checkpoint_offset",
    "children",
    "unrecorded",
    "default_process_group_backend",
    "distributed_is_initialized",
    "flatten_dense_tensors",
    "init_dist_connection",
    "layer_sync",
    "load_module_state",
    "migrate_checkpoint",
    "optimizer_to_device",
    "optimizers_to_device",
    "own_buffers",
    "own_parameters",
    "register_state_dict_hook",
    "running_loop_data",
    "set_example_input_slot",
    "set_sigterm_check",
    "sigterm_exception",
    "scaler_device",
    "scaler_optimizer_state",
    "scaler_scale",
    "should_accumulate",
    "sync_ddp",
    "train_dataloader",
    "unflatten_dense_tensors",
    "unwrap_optimizer",
]

OVERRIDDEN: tuple[tuple[type, str], ...] = (
    (pl.strategies.ParallelStrategy, "_configure_launcher"),  # GPipeStrategy overrides it
    (pl.strategies.ParallelStrategy, "_launcher"),  # ... and sets it there
    (SubprocessScriptLauncher, "_call_children_scripts"),  # GPipeLauncher overrides it
    (SubprocessScriptLauncher, "_check_can_spawn_children"),  # ... and calls it
)
"""Private members of Lightning classes that :class:`~lightning_gpipe.GPipeStrategy` and
:class:`~lightning_gpipe.strategy.launcher.GPipeLauncher` override, set or call on themselves."""


# -- Lightning ----------------------------------------------------------------------------------------


def train_dataloader(trainer: pl.Trainer) -> Any:
    """The training dataloader the fit loop will iterate (before the loop has set it up)."""
    return trainer.fit_loop._data_source.dataloader()


# the running loop (by TrainerFn value), and the LightningModule step that loop calls
_LOOPS = {
    "fit": ("fit_loop", "training_step"),
    "validate": ("validate_loop", "validation_step"),
    "test": ("test_loop", "test_step"),
    "predict": ("predict_loop", "predict_step"),
}


def running_loop_data(trainer: Any) -> tuple[str, Any]:
    """``(step name, dataloader)`` of the loop the Trainer runs now (before the loop has set it up);
    the first of several dataloaders."""
    loop, step = _LOOPS.get(getattr(trainer.state.fn, "value", "fit"), _LOOPS["fit"])
    loader = getattr(trainer, loop)._data_source.dataloader()
    return step, loader[0] if isinstance(loader, (list, tuple)) else loader


def set_sigterm_check(trainer: Any, check: Callable[[], None] | None) -> None:
    """Put ``check`` in place of the training epoch loop's per-step SIGTERM broadcast
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``, called at the start of every training step
    when several processes run), or Lightning's own back (``None``)."""
    loop = trainer.fit_loop.epoch_loop
    if check is None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)
    else:
        loop._broadcast_sigterm_tensor = check


def sigterm_exception(trainer: Any) -> type[BaseException]:
    """What the training epoch loop raises on a SIGTERM: its module's ``SIGTERMException`` (the
    ``pytorch_lightning`` or the ``lightning.pytorch`` one)."""
    return sys.modules[type(trainer.fit_loop.epoch_loop).__module__].SIGTERMException  # type: ignore[no-any-return]


def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether the current backward is followed by another before the optimizer step."""
    return bool(trainer.fit_loop._should_accumulate())


def layer_sync(strategy: pl.strategies.ParallelStrategy) -> Any:
    """``Trainer(sync_batchnorm=True)``'s layer sync plugin on the strategy, or ``None``."""
    return strategy._layer_sync


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or ``None`` (``module.trainer`` raises when there is none)."""
    return module._trainer


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    names = ("pytorch_lightning.core.optimizer", "lightning.pytorch.core.optimizer")  # either namespace
    return optimizer._optimizer if type(optimizer).__module__ in names else optimizer


def example_input_slot(module: pl.LightningModule) -> Any:
    """The module's ``example_input_array`` as stored (its property setter refuses ``None``)."""
    return module._example_input_array


def set_example_input_slot(module: pl.LightningModule, value: Any) -> None:
    """Store ``value`` (``None`` included) as the module's ``example_input_array``."""
    module._example_input_array = value


def throughputs(monitor: Any) -> list[Any]:
    """A ``ThroughputMonitor``'s ``Throughput`` objects (their ``world_size`` is writable)."""
    return list(monitor._throughputs.values())


# -- torch ----------------------------------------------------------------------------------------


def children(module: nn.Module) -> dict[str, Any]:
    """``module``'s children by name, repeated modules included (``named_children`` drops repeats)."""
    return module._modules


def own_parameters(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameter slots (not its children's), writable."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Any]:
    """``module``'s own buffer slots (not its children's), writable."""
    return module._buffers


def register_state_dict_hook(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``hook(module, state_dict, prefix, local_metadata)`` after ``module.state_dict()`` fills its keys."""
    return module._register_state_dict_hook(hook)


def scaler_device(scaler: GradScaler) -> str:
    """The device type a ``GradScaler`` was built for."""
    return scaler._device


def scaler_optimizer_state(scaler: GradScaler, optimizer: Optimizer) -> dict[str, Any]:
    """The scaler's per-optimizer record (``found_inf_per_device`` after ``unscale_``), writable."""
    return scaler._per_optimizer_states[id(optimizer)]


def scaler_scale(scaler: GradScaler) -> Any:
    """The scaler's current scale tensor (``None`` before its first ``scale``)."""
    return scaler._scale


def compiled_module(compiled: OptimizedModule) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles."""
    return compiled._orig_mod  # type: ignore[return-value]


def compile_like(compiled: OptimizedModule, module: nn.Module) -> nn.Module:
    """``module`` compiled with ``compiled``'s own ``torch.compile`` context (backend, mode,
    dynamic, options)."""
    return OptimizedModule(module, compiled.dynamo_ctx)


def checkpoint_offset(storage: Any) -> int | None:
    """Byte offset in the file of a storage that ``torch.load(map_location="meta")`` read (``None``:
    unknown)."""
    offset = getattr(storage, "_checkpoint_offset", None)
    return None if offset is None else int(offset)


def load_module_state(
    cls: type, checkpoint: dict[str, Any], strict: bool | None = None, **kwargs: Any
) -> Any:
    """Lightning's construction of a module from a checkpoint dict (``load_from_checkpoint`` without
    the file)."""
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def tree_flatten(value: Any) -> tuple[list[Any], TreeSpec]:
    """``value``'s leaves in order (tuple and list order, dict insertion order) and its structure
    (torch's pytree: dicts, lists, tuples, namedtuples and registered types are nodes; ``None`` and
    any other object is a leaf)."""
    return _tree_flatten(value)


def tree_unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`tree_flatten`: ``spec``'s structure holding ``leaves``."""
    return _tree_unflatten(leaves, spec)


def tree_leaf_paths(value: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``value``, paths written as indexing (``['rope'][0]``)."""
    return [(_keystr(path), leaf) for path, leaf in _tree_flatten_with_path(value)[0]]


def migrate_checkpoint(checkpoint: dict[str, Any], path: Any) -> dict[str, Any]:
    """Lightning's upgrade of an older checkpoint dict, as ``load_from_checkpoint`` applies it."""
    return _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)


@contextmanager
def unrecorded() -> Iterator[None]:
    """No profiler event (``RecordFunction``) is opened in this thread inside the context; on again after it.

    A Gloo ``isend`` posted while ``torch.profiler`` runs opens an event that its worker thread
    closes when the send completes. A send whose wait is deferred past the profiler's next
    ``step()`` (Lightning's ``PyTorchProfiler`` steps when a training or validation step returns)
    then writes into the event list of a cycle already freed: heap corruption, a segmentation
    fault or ``free(): invalid next size`` later in ``prepare_trace``. Sends posted here carry no
    event. (``torch._C._autograd._enable_record_function``; RecordFunction is on by default.)
    """
    _enable_record_function(False)
    try:
        yield
    finally:
        _enable_record_function(True)
