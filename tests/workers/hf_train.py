"""Worker: train a tests.hf_models module (causal LM or image classifier) under GPipeStrategy for
each run in a JSON spec.

Usage: python tests/workers/hf_train.py SPEC.json. Spec keys: devices, out, runs (``family``,
``steps`` (default 5), ``ckpt_path`` (fit from that checkpoint) and GPipeStrategy kwargs). Every rank
writes ``run{k}_rank{r}.pt`` (losses, parameters after every step); rank 0 also writes the trained
``state_dict``; the saved checkpoint is ``run{k}.ckpt`` (a directory under ``checkpoint_format="sharded"``).
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

import lightning_gpipe
from tests.hf_models import module_and_data
from tests.models import trainer_kwargs

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
for k, run in enumerate(spec["runs"]):
    run = dict(run)
    family, steps, ckpt_path = run.pop("family"), run.pop("steps", 5), run.pop("ckpt_path", None)
    pl.seed_everything(0, verbose=False)
    model, data = module_and_data(family, steps)
    strategy = lightning_gpipe.GPipeStrategy(**run)
    trainer = pl.Trainer(strategy=strategy, devices=spec["devices"], **trainer_kwargs(steps))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    trainer.save_checkpoint(out / f"run{k}.ckpt")
    record = {"losses": model.losses, "params": getattr(model, "params", [])}
    if trainer.global_rank == 0:
        record["state"] = {n: t.clone() for n, t in model.state_dict().items()}
    torch.save(record, out / f"run{k}_rank{trainer.global_rank}.pt")
