"""Worker: rank 0 (the launching process) fails after starting the other ranks, before the rendezvous.

Usage: python tests/workers/rank0_fails_early.py
``configure_callbacks`` runs before the process group exists; it raises on local rank 0 only.
"""

import os

import pytorch_lightning as pl

import lightning_gpipe
from tests.models import Net, make_data, trainer_kwargs


class FailsOnLauncher(Net):
    def configure_callbacks(self):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise RuntimeError("rank 0 cannot read its data")
        return []


trainer = pl.Trainer(strategy=lightning_gpipe.GPipeStrategy(), devices=3, **trainer_kwargs(2))
trainer.fit(FailsOnLauncher("mlp"), make_data("mlp"))
