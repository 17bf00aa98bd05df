"""Worker: fit tests.models.Net("mlp") on 2 stages with ``GPipeStrategy(timeline=True)`` and a CSV logger.

Usage: python tests/workers/timeline_fit.py OUT_DIR CHUNKS
Rank 0 leaves ``OUT_DIR/csv/.../metrics.csv`` (with ``pipeline/bubble``), ``OUT_DIR/timeline.json``
and ``OUT_DIR/timeline.png``.
"""

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

import lightning_gpipe
from tests.models import Net, make_data, trainer_kwargs

torch.set_num_threads(1)
out, chunks = Path(sys.argv[1]), int(sys.argv[2])
pl.seed_everything(0, verbose=False)
strategy = lightning_gpipe.GPipeStrategy(
    chunks=chunks, checkpoint="except_last", timeline=True, timeline_dir=str(out)
)
kwargs = dict(trainer_kwargs(4), logger=CSVLogger(out / "csv"), log_every_n_steps=1)
trainer = pl.Trainer(strategy=strategy, devices=2, **kwargs)
trainer.fit(Net("mlp"), make_data("mlp", batch=8, steps=4))
if trainer.global_rank == 0:
    assert strategy.timeline_records is not None and len(strategy.timeline_records) == 2
print("worker done")
