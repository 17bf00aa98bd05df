"""Worker: validate, validate, train one step, validate — 20 times, with fresh Trainers in one job.

Usage: python tests/workers/alternate.py OUT DEVICES CHUNKS ROUNDS
Rank 0 writes ``alternate.pt`` with every validation loss and the final state.
"""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

import lightning_gpipe
from tests.models import alternate

torch.set_num_threads(1)
out, devices, chunks, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def trainer(**kwargs):
    return pl.Trainer(strategy=lightning_gpipe.GPipeStrategy(chunks=chunks), devices=devices, **kwargs)


model, losses = alternate(trainer, rounds)
if model.trainer.global_rank == 0:
    torch.save({"val_losses": losses, "state": model.state_dict()}, out / "alternate.pt")
