"""What the image data modules share: shuffled training batches (resumable mid-epoch), ordered
validation batches."""

from __future__ import annotations

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset

from recipes.data.recorded_shuffle import RecordedShuffle
from recipes.data.resumable_loader import ResumableLoader


class SplitDataModule(pl.LightningDataModule):
    """A data module whose ``setup()`` fills ``train_set`` and ``val_set``.

    Training batches are shuffled (a :class:`~recipes.data.resumable_loader.ResumableLoader`, resumable
    mid-epoch) and the last incomplete one dropped; validation batches keep
    their order. Subclasses set ``batch_size`` and ``num_workers``.
    """

    train_set: Dataset | None
    val_set: Dataset | None
    batch_size: int
    num_workers: int

    def train_dataloader(self) -> ResumableLoader:
        self.setup()
        assert self.train_set is not None
        return ResumableLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=RecordedShuffle(self.train_set),  # shuffle=True's order, resumable mid-epoch
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
