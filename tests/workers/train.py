"""Worker: train tests.models.Net under GPipeStrategy for each run in a JSON spec.

Usage: python tests/workers/train.py SPEC.json
Lightning's launcher re-runs this command for the other ranks. Every rank writes
``run{k}_rank{r}.pt`` with what its module recorded (losses, gradients, clipped gradients,
norms, sample indices, callback metrics, best checkpoint path, stop epoch); rank 0 (a last
stage) also writes the full trained state.

Spec keys: kind, devices, runs (GPipeStrategy kwargs per run), steps, batch, seed, lr,
net (Net kwargs), trainer (extra Trainer kwargs), val (add a validation loader),
callbacks ({"checkpoint": ModelCheckpoint kwargs, "early_stopping": EarlyStopping kwargs}),
save (checkpoint file name to write after fit), resume ({"ckpt": path, "steps": total steps}),
predict (run trainer.predict on the validation data after fit).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402

import lightning_gpipe  # noqa: E402
from tests.models import Net, make_data, trainer_kwargs  # noqa: E402

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
net_kwargs = dict(spec.get("net", {}))
for key in ("record_grads", "call_twice", "fail", "wrong_shape"):
    if key in spec:
        net_kwargs[key] = spec[key]
steps, batch, kind = spec.get("steps", 5), spec.get("batch", 10), spec["kind"]
indexed = net_kwargs.get("indexed", False)


def trainer_for(run, max_steps, callbacks=()):
    kwargs = {**trainer_kwargs(max_steps), **spec.get("trainer", {})}
    strategy = lightning_gpipe.GPipeStrategy(**run)
    return pl.Trainer(strategy=strategy, devices=spec["devices"], callbacks=list(callbacks), **kwargs)


for k, run in enumerate(spec["runs"]):
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    model = Net(kind, lr=spec.get("lr", 0.1), **net_kwargs)
    callbacks = []
    if "checkpoint" in spec.get("callbacks", {}):
        callbacks.append(ModelCheckpoint(dirpath=out / f"ckpt{k}", **spec["callbacks"]["checkpoint"]))
    if "early_stopping" in spec.get("callbacks", {}):
        callbacks.append(EarlyStopping(**spec["callbacks"]["early_stopping"]))
    val = (
        make_data(kind, batch, 2, seed=2, indexed=indexed, samples=spec.get("val_samples"))
        if spec.get("val")
        else None
    )
    trainer = trainer_for(run, steps, callbacks)
    trainer.fit(
        model, make_data(kind, batch, max(steps, 5), indexed=indexed, samples=spec.get("samples")), val
    )
    record = {
        "losses": model.losses,
        "synced_losses": model.synced_losses,
        "shapes": model.shapes,
        "grads": model.grads,
        "clipped": model.clipped,
        "norms": model.norms,
        "indices": model.indices,
        "callback_metrics": {m: v.item() for m, v in trainer.callback_metrics.items()},
        "best_model_path": callbacks[0].best_model_path
        if callbacks and isinstance(callbacks[0], ModelCheckpoint)
        else None,
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }
    if spec.get("save"):
        trainer.save_checkpoint(out / spec["save"])
    if spec.get("predict"):
        preds = trainer.predict(model, make_data(kind, batch, 2, seed=2, indexed=indexed))
        record["predictions"] = preds
    if spec.get("resume"):
        model = Net(kind, lr=spec.get("lr", 0.1), **net_kwargs)
        trainer = trainer_for(run, spec["resume"]["steps"])
        trainer.fit(
            model, make_data(kind, batch, max(steps, 5), indexed=indexed), ckpt_path=spec["resume"]["ckpt"]
        )
        record["resumed_losses"] = model.losses
    rank = trainer.global_rank
    if rank == 0:
        record["state"] = {n: t.clone() for n, t in model.state_dict().items()}
    torch.save(record, out / f"run{k}_rank{rank}.pt")
print(f"worker rank {os.environ.get('LOCAL_RANK', '0')} done")
