"""Worker: fit tests.llama.Llama under GPipeStrategy with tensor parallelism, once per run in a JSON spec.

Usage: python tests/workers/tensor_parallel.py SPEC.json, started once per rank with RANK/WORLD_SIZE set.
Spec keys: devices, out, steps, clip (gradient_clip_val), runs (GPipeStrategy kwargs per run; "model":
"llama" (default) or "sharded_logits", the module of that run). Every rank
writes ``run{k}_rank{r}.pt``: the losses and total gradient norms its module recorded (the last stage's are
the step's), the DTensor parameters its stage held as training started, its mesh coordinate, and the whole
trained ``state_dict`` after fit and
the whole model's output on the first batch after fit (``after_fit``: plain layers, run in this process).
At the end of training each run saves ``run{k}.ckpt`` (its ``checkpoint_format``); with ``resume`` (Trainer
overrides: ``max_steps``, ``max_epochs``) a new module fits on from it (``resumed_losses``, ``resumed_norms``,
``resumed_state``). With ``validate``, ``trainer.validate(ckpt_path=run{k}.ckpt)`` on the first batch
after fit, with the same trainer and module (``val_losses``).
"""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

import lightning_gpipe
from tests.llama import Llama, ShardedLogits, llama_data
from tests.models import trainer_kwargs

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])


class SaveAtTrainEnd(pl.Callback):
    """``trainer.save_checkpoint`` at the end of training, while every stage holds its parallelized layers."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


MODELS = {"llama": Llama, "sharded_logits": ShardedLogits}
for k, run in enumerate(spec["runs"]):
    run = dict(run)
    make = MODELS[run.pop("model", "llama")]
    pl.seed_everything(0, verbose=False)
    model = make()
    trainer = pl.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(**run),
        devices=spec["devices"],
        gradient_clip_val=spec["clip"],
        callbacks=[SaveAtTrainEnd(out / f"run{k}.ckpt")],
        **trainer_kwargs(spec["steps"]),
    )
    trainer.fit(model, llama_data(steps=spec["steps"]))
    record = {
        "losses": model.losses,
        "norms": model.norms,
        "dtensor_parameters": model.dtensor_parameters,
        "dtensor_mesh_dims": model.dtensor_mesh_dims,
        "dtensor_outputs": model.dtensor_outputs,
        "coordinate": model.device_mesh.get_coordinate(),
        "stage": trainer.strategy.stage_index,
        "state": {n: t.detach().clone() for n, t in model.state_dict().items()},
        "after_fit": model(next(iter(llama_data()))[0]).detach(),  # the whole model, plain, on this process
    }
    if spec.get("validate"):  # the same trainer and module, from the checkpoint saved at the end of training
        trainer.validate(model, llama_data(steps=1), ckpt_path=str(out / f"run{k}.ckpt"), verbose=False)
        record["val_losses"] = model.val_losses
    if spec.get("resume"):  # a new module fit on from the checkpoint, to the step and epoch limits given
        model = make()
        kwargs = {**trainer_kwargs(spec["steps"]), **spec["resume"]}
        strategy = lightning_gpipe.GPipeStrategy(**run)
        trainer = pl.Trainer(
            strategy=strategy, devices=spec["devices"], gradient_clip_val=spec["clip"], **kwargs
        )
        trainer.fit(model, llama_data(steps=spec["steps"]), ckpt_path=str(out / f"run{k}.ckpt"))
        record["resumed_losses"], record["resumed_norms"] = model.losses, model.norms
        record["resumed_state"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    torch.save(record, out / f"run{k}_rank{trainer.global_rank}.pt")
print(f"worker rank {os.environ.get('LOCAL_RANK', '0')} done")
