"""The recipe's ``last.ckpt`` on an interval from the start and at the end of training (issue 41, item 6)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from typing_extensions import override


class LastCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that writes ``last.ckpt`` only: every ``every_n_train_steps`` steps or
    ``train_time_interval``, and once more when training ends on a step it has not saved.

    Lightning's ``save_last=True`` writes ``last.ckpt`` at training's end only when the callback
    has never saved; a run whose last step falls between two intervals would leave a ``last.ckpt``
    of an earlier step, and a resumed finished run would train those steps again.

    Args:
        dirpath (str | Path): the checkpoint directory.
        **kwargs: ``ModelCheckpoint``'s interval arguments (``every_n_train_steps``,
            ``train_time_interval``) and ``enable_version_counter``.
    """

    def __init__(self, dirpath: Any, **kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, **kwargs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
