"""What ``GPipeStrategy``'s checkpoint hooks do: save and restore the state of one rank's stage.

Lightning asks a strategy, in this order, for the model's ``state_dict`` and each optimizer's
state (saving), then writes the checkpoint; or reads a checkpoint and loads the model's and the
optimizers' states from it (restoring, after setup: into the partitioned module). With
``checkpoint_format="full"`` the model's and optimizers' states are gathered to rank 0 under the
user's names (:mod:`lightning_gpipe.state`) and Lightning's ``CheckpointIO`` writes one file; a
full file is read back stage by stage, lazily (:mod:`lightning_gpipe.state.loading`). With
``"sharded"`` every stage writes and reads its own shard (:mod:`lightning_gpipe.state.sharded`).
:class:`SavedState` keeps the file being restored between the hooks that read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe import state
from lightning_gpipe._lightning import distributed_is_initialized, unwrap_optimizer
from lightning_gpipe.state import loading, sharded
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.layout import Layout

if TYPE_CHECKING:  # the hooks are typed as the pytorch_lightning strategy they become part of
    import pytorch_lightning as pl
    from pytorch_lightning.strategies.parallel import ParallelStrategy as _Base
else:
    _Base = object

__all__ = ["CheckpointHooks", "SavedState"]


class SavedState:
    """Save and restore the state of the stage ``pipelined`` holds, as Lightning's checkpoint hooks ask.

    Attributes:
        pipelined: the stage installed in the module, with the names saved state is translated by.
        lazy: the full checkpoint file being restored (read tensor by tensor when loaded), from
            :meth:`load` until the strategy's teardown.
    """

    def __init__(self, pipelined: Pipelined) -> None:
        self.pipelined = pipelined
        self.lazy: loading.LazyCheckpoint | None = None

    def save_sharded(
        self, checkpoint: dict[str, Any], filepath: Any, module: nn.Module, optimizers: Sequence[Optimizer]
    ) -> bool:
        """Write this stage's shard of a sharded checkpoint; ``False`` (nothing written) without process groups."""
        if not distributed_is_initialized():
            return False
        sharded.save_sharded(checkpoint, filepath, module, list(optimizers))
        return True

    def load(
        self,
        path: Any,
        weights_only: bool | None,
        module: nn.Module | None,
        optimizers: Sequence[Optimizer],
        read: Callable[..., dict[str, Any]],
    ) -> dict[str, Any]:
        """Read this rank's part of a checkpoint, with torch's safe unpickler unless ``weights_only=False``.

        ``weights_only`` decides how every file is unpickled, the sharded checkpoint's metadata
        included. A full checkpoint file is read stage by stage
        (:func:`lightning_gpipe.state.loading.stage_part`): the other stages' tensors are never read,
        this stage's are read when loaded. A path that is not a local file is read by
        ``read(path, weights_only=...)`` (the strategy's ``CheckpointIO``), safely unless opted out.

        Raises:
            UnsafeCheckpointError: the safe unpickler refuses the file (the message names it
                and the opt-in).
        """
        if sharded.is_sharded(path):
            assert module is not None
            return sharded.load_sharded(path, module, list(optimizers), weights_only)
        if not os.path.isfile(path):
            return read(path, weights_only=loading.safe(weights_only))
        self.lazy = loading.LazyCheckpoint(path, weights_only)
        owners = self.pipelined.owners()  # tied copies' states
        return loading.stage_part(self.lazy, module, self.pipelined.plain_names, owners)

    def model_state(
        self, module: nn.Module, layout: Layout, rank: int, arrive: Callable[[str], None]
    ) -> dict[str, Any]:
        """The user's full ``state_dict`` (original parameter names) on rank 0, gathered from all stages."""
        p = self.pipelined
        return state.module_state_dict(module, p.stage, p.name, layout, rank, arrive, p.tied)

    def optimizer_state(
        self,
        optimizer: Optimizer,
        module: nn.Module,
        layout: Layout,
        rank: int,
        arrive: Callable[[str], None],
    ) -> dict[str, Any]:
        """On rank 0: one optimizer ``state_dict`` over the whole model (:func:`.merged_optimizer_state`)."""
        optimizer = unwrap_optimizer(optimizer)
        if distributed_is_initialized() and layout.world_size > 1:
            arrive("gathering optimizer states (save_checkpoint)")
        order, aliases = self.pipelined.plain_names, self.pipelined.tied_aliases()
        return state.merged_optimizer_state(optimizer, module, layout, rank, order, aliases)

    def load_optimizer_states(
        self, checkpoint: Any, module: nn.Module, optimizers: Sequence[Optimizer], device: torch.device
    ) -> None:
        """Give each stage's optimizer its part of the checkpoint's optimizer states (matched by parameter name)."""
        states = checkpoint["optimizer_states"]
        if checkpoint.get(sharded.SHARDED_KEY):
            return sharded.set_sharded_optimizer_states(module, list(optimizers), states)
        plain, lazy = self.pipelined.plain_names, self.lazy
        state.load_optimizer_states(
            module, optimizers, states, plain, device,
            tied_aliases=self.pipelined.tied_aliases(), read=lazy.materialize if lazy is not None else None,
        )  # fmt: skip

    def load_model_state(self, module: nn.Module, checkpoint: Any, strict: bool = True) -> None:
        """Load a full checkpoint into the full or the partitioned module (keeping this stage's keys)."""
        partitioned = self.pipelined.stage is not None
        loading.load_model_state(module, checkpoint["state_dict"], strict, self.lazy, partitioned)


class CheckpointHooks(_Base):
    """``GPipeStrategy``'s checkpoint hooks, each handing its work to the strategy's :class:`SavedState`."""

    _saved: SavedState
    _pipelined: Pipelined
    checkpoint_format: str
    weights_only: bool | None
    virtual_stages: int
    balance: list[int] | str | None

    if TYPE_CHECKING:  # the strategy's own, declared for the type checker

        @property
        def layout(self) -> Layout: ...

        @property
        def chunks_used(self) -> int: ...

        @property
        def _module(self) -> pl.LightningModule: ...

        def _arrive(self, operation: str, ranks: list[int] | None = None) -> None: ...

    @property
    def balance_used(self) -> list[int] | None:
        """The balance the stages were cut with (layers per stage); ``None`` before setup."""
        return self._pipelined.balance

    @property
    def _torch_optimizers(self) -> list[Optimizer]:
        return [unwrap_optimizer(o) for o in self.optimizers]

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the partitioned module, each stage taking its own part."""
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write the checkpoint (``checkpoint_format``), recording the pipeline under ``checkpoint["gpipe"]``."""
        record = {"balance": self.balance_used, "balance_by": self.balance, "chunks": self.chunks_used}
        checkpoint["gpipe"] = {**record, "stages": self.layout.stages, "virtual_stages": self.virtual_stages}
        if self.checkpoint_format == "sharded":
            if self._saved.save_sharded(checkpoint, filepath, self._module, self._torch_optimizers):
                return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's part of a checkpoint (:meth:`.SavedState.load`), unpickled safely unless
        ``weights_only=False`` (``None``: the strategy's ``weights_only``).

        Raises:
            UnsafeCheckpointError: the safe unpickler refuses the file (the message names it
                and the opt-in).
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        module, optimizers = self.lightning_module, self._torch_optimizers
        return self._saved.load(checkpoint_path, weights_only, module, optimizers, super().load_checkpoint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The user's full ``state_dict`` (original parameter names) on rank 0, gathered from all stages."""
        if self.checkpoint_format == "sharded":
            return {}  # each stage writes its own shard in save_checkpoint
        return self._saved.model_state(self._module, self.layout, self.global_rank, self._arrive)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """On rank 0: one optimizer ``state_dict`` over the whole model (:func:`.state.merged_optimizer_state`)."""
        if self.checkpoint_format == "sharded":
            return {}  # each stage writes its own shard in save_checkpoint
        return self._saved.optimizer_state(
            optimizer, self._module, self.layout, self.global_rank, self._arrive
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Give each stage's optimizer its part of the merged optimizer states (matched by parameter name)."""
        self._saved.load_optimizer_states(checkpoint, self._module, self._torch_optimizers, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a full checkpoint into the full or the partitioned module (keeping this stage's keys)."""
        self._saved.load_model_state(self._module, checkpoint, strict)
