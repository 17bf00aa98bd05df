"""What ``GPipeStrategy``'s checkpoint hooks do: save and restore the state of one rank's stage.

Lightning asks a strategy, in this order, for the model's ``state_dict`` and each optimizer's
state (saving), then writes the checkpoint; or reads a checkpoint and loads the model's and the
optimizers' states from it (restoring, after setup: into the partitioned module). With
``checkpoint_format="full"`` the model's and optimizers' states are gathered to rank 0 under the
user's names (:mod:`lightning_gpipe.state`) and Lightning's ``CheckpointIO`` writes one file; a
full file is read back stage by stage, lazily (:mod:`lightning_gpipe.loading`). With
``"sharded"`` every stage writes and reads its own shard (:mod:`lightning_gpipe.state.sharded`).
:class:`SavedState` keeps the file being restored between the hooks that read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_gpipe import loading, state
from lightning_gpipe._compat import distributed_is_initialized, unwrap_optimizer
from lightning_gpipe.layout import Layout
from lightning_gpipe.pipelined import Pipelined
from lightning_gpipe.state import sharded

__all__ = ["SavedState"]


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
        (:func:`lightning_gpipe.loading.stage_part`): the other stages' tensors are never read,
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
