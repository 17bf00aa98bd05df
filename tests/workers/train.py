"""Worker: train tests.models.Net under GPipeStrategy for each run in a JSON spec.

Usage: python tests/workers/train.py SPEC.json
Lightning's launcher re-runs this command for the other ranks. Rank 0 (the last stage) writes
``run{k}.pt`` with the per-step losses, output shapes and the full trained state; every rank
writes ``run{k}_rank{r}.pt`` with the gradients its stage saw.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

import lightning_gpipe  # noqa: E402
from tests.models import Net, make_data, trainer_kwargs  # noqa: E402

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
for k, run in enumerate(spec["runs"]):
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    model = Net(
        spec["kind"],
        lr=spec.get("lr", 0.1),
        record_grads=spec.get("record_grads", False),
        call_twice=spec.get("call_twice", False),
        fail=spec.get("fail"),
        wrong_shape=spec.get("wrong_shape", False),
    )
    strategy = lightning_gpipe.GPipeStrategy(**run)
    trainer = pl.Trainer(strategy=strategy, devices=spec["devices"], **trainer_kwargs(spec.get("steps", 5)))
    trainer.fit(model, make_data(spec["kind"], spec.get("batch", 10), spec.get("steps", 5)))
    rank = trainer.global_rank
    torch.save({"grads": model.grads}, out / f"run{k}_rank{rank}.pt")
    if rank == 0:
        state = {n: t.clone() for n, t in model.state_dict().items()}
        torch.save({"losses": model.losses, "shapes": model.shapes, "state": state}, out / f"run{k}.pt")
print(f"worker rank {os.environ.get('LOCAL_RANK', '0')} done")
