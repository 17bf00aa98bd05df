"""Every private Lightning internal the package relies on, in one place.

Checked against pytorch-lightning / lightning-fabric 2.6. Each entry is tested in
``tests/test_compat.py``. Only the Lightning glue (:mod:`lightning_gpipe.strategy`) and the
checkpoint files (:mod:`lightning_gpipe.state`) import it: the engine, the transport, the schedules
and the partition run without Lightning.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.strategies import _StrategyRegistry as StrategyRegistry
from lightning_fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning_fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning_fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from lightning_fabric.utilities.distributed import _sync_ddp as sync_ddp
from lightning_fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE
from lightning_fabric.utilities.optimizer import _optimizer_to_device as optimizer_to_device
from lightning_fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from pytorch_lightning.core.saving import _load_state
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from pytorch_lightning.utilities.migration.utils import _pl_migrate_checkpoint
from torch.optim import Optimizer

__all__ = [
    "IS_INTERACTIVE",
    "MultiProcessingLauncher",
    "OVERRIDDEN",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "default_process_group_backend",
    "distributed_is_initialized",
    "example_input_slot",
    "init_dist_connection",
    "layer_sync",
    "load_module_state",
    "migrate_checkpoint",
    "optimizer_to_device",
    "optimizers_to_device",
    "running_loop_data",
    "clear_device_meshes",
    "set_device_mesh",
    "set_example_input_slot",
    "set_sigterm_check",
    "set_num_threads_if_needed",
    "set_sigterm_notifier",
    "should_accumulate",
    "sigterm_exception",
    "sync_ddp",
    "throughputs",
    "train_dataloader",
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


def train_dataloader(trainer: pl.Trainer) -> Any:
    """The training dataloader the fit loop will iterate (before the loop has set it up)."""
    return trainer.fit_loop._data_source.dataloader()


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


def set_sigterm_notifier(trainer: Any, notifier: Callable[[int, Any], None] | None) -> None:
    """Put ``notifier(signum, frame)`` in place of the Trainer's SIGTERM notifier
    (``_SignalConnector._sigterm_notifier_fn``, which passes the signal on to the launched ranks,
    broadcasts from the signal handler and sets ``received_sigterm``), or Lightning's own back
    (``None``). Takes effect where the Trainer registers its signal handlers, after the strategy's
    ``setup``."""
    connector = trainer._signal_connector
    if notifier is None:
        connector.__dict__.pop("_sigterm_notifier_fn", None)
    else:
        connector._sigterm_notifier_fn = notifier


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


_MESHED: weakref.WeakSet[Any] = weakref.WeakSet()


def set_device_mesh(module: pl.LightningModule | None, mesh: Any) -> None:
    """Store ``mesh`` as the module's ``device_mesh`` (a read-only property), as Lightning's
    ``ModelParallelStrategy`` does; nothing without a module. Modules given a mesh are remembered
    (weakly) for :func:`clear_device_meshes`."""
    if module is not None:
        module._device_mesh = mesh
        if mesh is not None:
            _MESHED.add(module)


def clear_device_meshes() -> None:
    """Set ``device_mesh`` back to ``None`` on every module still alive that was given one: a mesh
    holds its process groups, and a group alive at interpreter exit aborts it
    (:func:`lightning_gpipe.transport.groups.close_at_exit`), also the mesh of a module trained by
    an earlier ``fit`` and kept by the script."""
    for module in list(_MESHED):
        module._device_mesh = None
    _MESHED.clear()


def throughputs(monitor: Any) -> list[Any]:
    """A ``ThroughputMonitor``'s ``Throughput`` objects (their ``world_size`` is writable)."""
    return list(monitor._throughputs.values())


def load_module_state(
    cls: type, checkpoint: dict[str, Any], strict: bool | None = None, **kwargs: Any
) -> Any:
    """Lightning's construction of a module from a checkpoint dict (``load_from_checkpoint`` without
    the file)."""
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def migrate_checkpoint(checkpoint: dict[str, Any], path: Any) -> dict[str, Any]:
    """Lightning's upgrade of an older checkpoint dict, as ``load_from_checkpoint`` applies it."""
    return _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
