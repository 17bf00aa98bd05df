"""The recipe's last.ckpt: on its step interval from the start, at the end of training, and where a
signal stops training."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from recipes.last_checkpoint import LastCheckpoint
from tests.conftest import max_diff
from tests.models import Net, make_data, trainer_kwargs


class _Steps(pl.Callback):
    """The global step of ``last.ckpt`` at each training step's end, before this step's save
    (Lightning runs checkpoint callbacks last)."""

    def __init__(self, path):
        self.path, self.seen = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(
            torch.load(self.path, weights_only=False)["global_step"] if self.path.exists() else None
        )


def test_last_checkpoint_follows_its_interval_and_ends_on_the_last_step(tmp_path):
    pl.seed_everything(0, verbose=False)
    last = LastCheckpoint(tmp_path, every_n_train_steps=3, enable_version_counter=False)
    steps = _Steps(tmp_path / "last.ckpt")
    kwargs = {**trainer_kwargs(7), "enable_checkpointing": True, "max_epochs": -1}
    trainer = pl.Trainer(devices=1, callbacks=[last, steps], **kwargs)
    trainer.fit(Net("mlp", lr=0.1), make_data("mlp", 10, 5))
    assert steps.seen == [None, None, None, 3, 3, 3, 6]  # saved at steps 3 and 6 ...
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 7  # ... and at the end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


class _StopAt(pl.Callback):
    """Raise ``error`` where Lightning's own SIGTERM check does (and GPipeStrategy's stop on every rank):
    at the start of the training step after global step ``at``, before its batch is fetched."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error = at, error

    def on_train_start(self, trainer, pl_module):
        loop = trainer.fit_loop.epoch_loop
        advance = loop.advance

        def stop_at(data_fetcher):
            if trainer.global_step == self.at:
                raise self.error
            advance(data_fetcher)

        loop.advance = stop_at


def _fit(tmp_path, steps, callbacks=(), ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    model = Net("mlp", lr=0.1)
    kwargs = {**trainer_kwargs(steps), "enable_checkpointing": True, "max_epochs": -1}
    last = LastCheckpoint(tmp_path, every_n_train_steps=3, enable_version_counter=False)
    trainer = pl.Trainer(devices=1, callbacks=[last, *callbacks], **kwargs)
    trainer.fit(model, make_data("mlp", 10, 5, samples=10), ckpt_path=ckpt_path)  # one batch an epoch
    return model


@pytest.mark.parametrize(("error", "saved"), [(SIGTERMException(143), 4), (ValueError("a failed step"), 3)])
def test_last_checkpoint_is_written_where_a_signal_stops_training_and_resumes_exactly(tmp_path, error, saved):
    """A stop by SIGTERM after step 4 writes last.ckpt of step 4 (between the interval's steps 3 and 6),
    from which a resumed run ends with the uninterrupted run's weights; another exception leaves the
    interval's step-3 last.ckpt."""
    with pytest.raises(type(error)):
        _fit(tmp_path, 7, [_StopAt(4, error)])
    last = tmp_path / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == saved
    resumed = _fit(tmp_path, 7, ckpt_path=str(last))
    straight = _fit(tmp_path / "straight", 7)
    assert max_diff(resumed.state_dict(), straight.state_dict()) == 0.0
