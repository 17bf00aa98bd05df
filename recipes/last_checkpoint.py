"""The recipe's ``last.ckpt`` on an interval from the start, at the end of training and at a stop by a
signal (issue 41, items 4 and 6)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override


class LastCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that writes ``last.ckpt`` only: every ``every_n_train_steps`` steps or
    ``train_time_interval`` (neither: no interval), once more when training ends on a step it has not
    saved, and when a signal stops training.

    Lightning's ``save_last=True`` writes ``last.ckpt`` at training's end only when the callback
    has never saved; a run whose last step falls between two intervals would leave a ``last.ckpt``
    of an earlier step, and a resumed finished run would train those steps again.

    A ``SIGTERM`` (or a first ``SIGINT``) stops every rank at the same step boundary with Lightning's
    ``SIGTERMException`` (``GPipeStrategy``'s signal handling, docs/lightning.md "Errors and
    failures"); there ``last.ckpt`` is written in ``on_exception`` with every rank present, as
    Lightning's ``OnExceptionCheckpoint`` would write its own file, so that ``fit(ckpt_path="last")``
    resumes from the step the job stopped at. Other exceptions write nothing: a failed step or a
    dead rank leaves the ranks at different points, and the ``last.ckpt`` of the interval stays.

    Args:
        dirpath (str | Path): the checkpoint directory.
        **kwargs: ``ModelCheckpoint``'s interval arguments (``every_n_train_steps``,
            ``train_time_interval``) and ``enable_version_counter``.
    """

    def __init__(self, dirpath: Any, **kwargs: Any) -> None:
        if kwargs.get("every_n_train_steps") is None and kwargs.get("train_time_interval") is None:
            kwargs.setdefault("every_n_epochs", 0)  # no interval (ModelCheckpoint's default: every epoch)
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, **kwargs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if (
            isinstance(exception, SIGTERMException)
            and self._last_global_step_saved != trainer.global_step
            and not trainer.fast_dev_run
            and not trainer.sanity_checking
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
