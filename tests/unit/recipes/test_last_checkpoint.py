"""The recipe's last.ckpt: on its step interval from the start, and at the end of training."""

import pytorch_lightning as pl
import torch

from recipes.last_checkpoint import LastCheckpoint
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
