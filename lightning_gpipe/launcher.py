"""Process launcher: Lightning's subprocess launcher, validating before any child starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

if TYPE_CHECKING:
    from lightning_gpipe.strategy import GPipeStrategy


class GPipeLauncher(_SubprocessScriptLauncher):
    """Starts one process per stage by re-running the script (Lightning's "popen" launcher).

    Before the children start, the strategy checks the model against its configuration (the
    pipelined Sequential exists, the balance fits it), so a bad configuration fails in one
    process, fast.
    """

    def __init__(self, strategy: GPipeStrategy, num_processes: int, num_nodes: int) -> None:
        assert strategy.cluster_environment is not None
        super().__init__(strategy.cluster_environment, num_processes, num_nodes)
        self.strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = args[0] if args else None
        if isinstance(model, pl.LightningModule):
            self.strategy.check_model(model)
        return super().launch(function, *args, trainer=trainer, **kwargs)
