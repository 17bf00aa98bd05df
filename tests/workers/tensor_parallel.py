"""Worker: fit tests.llama.Llama under GPipeStrategy with tensor parallelism, once per run in a JSON spec.

Usage: python tests/workers/tensor_parallel.py SPEC.json, started once per rank with RANK/WORLD_SIZE set.
Spec keys: devices, out, steps, clip (gradient_clip_val), runs (GPipeStrategy kwargs per run, and: "model":
"llama" (default), "sharded_logits", "gpt" (tests.gpt.TensorParallelGPT under ``plan=PLAN``, its tied
embedding and head plain), "gpt_tied_plan" (those two parallelized too) or "gpt_embed_plan" (the embedding
alone), "llama_nan" and "llama_none" (``training_step``'s loss times NaN, or ``None``, at global step 1;
a refused fit is recorded as ``caught`` with its ``global_step``), the module of that run; "build":
"meta" builds it under ``Trainer.init_module(empty_init=True)`` (stage-only materialization); "precision":
the Trainer's; "resume_from": the index of an earlier run whose checkpoint this run fits on from, with
"trainer": Trainer overrides such as max_steps). Every rank writes ``run{k}_rank{r}.pt``: the losses,
total gradient norms and ``grad_norm(self)`` totals its module recorded (the last stage's losses and norms
are the step's), the DTensor parameters its stage held as training started, its mesh coordinate, the
balance used,
``trainer.callback_metrics`` after fit, the trained ``state_dict`` after fit (the whole model's; a
stage-only build's: its stage's) and the whole model's output on the first batch after fit
(``after_fit``: plain layers, run in this process; not for a stage-only build).
At the end of training each run saves ``run{k}.ckpt`` (its ``checkpoint_format``); with ``resume`` (Trainer
overrides: ``max_steps``, ``max_epochs``) a new module fits on from it (``resumed_losses``, ``resumed_norms``,
``resumed_state``). With ``validate`` (the spec's, or the run's), ``trainer.validate(ckpt_path=run{k}.ckpt)``
on the first batch after fit, with the same trainer and module (``val_losses``; Llama models).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

import lightning_gpipe
from tests.gpt import PLAN, TP_VOCAB, TensorParallelGPT, gpt_data
from tests.llama import Llama, OddStepLlama, ShardedLogits, llama_data
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


MODELS = {
    "llama": Llama,
    "sharded_logits": ShardedLogits,
    "gpt": TensorParallelGPT,
    "gpt_tied_plan": lambda: TensorParallelGPT(tied_plan="both"),
    "gpt_embed_plan": lambda: TensorParallelGPT(tied_plan="embed"),
    "llama_nan": lambda: OddStepLlama(nan_at=1),
    "llama_none": lambda: OddStepLlama(none_at=1),
}


def data(name: str):
    """The run's training data: the Llama's (``steps`` batches of 8) or (GPT models) the GPT's (4 of 8)."""
    return gpt_data(vocab=TP_VOCAB) if name.startswith("gpt") else llama_data(steps=spec["steps"])


for k, run in enumerate(spec["runs"]):
    run = dict(run)
    name = run.pop("model", "llama")
    make, build, precision = MODELS[name], run.pop("build", "eager"), run.pop("precision", "32-true")
    resume_from, overrides = run.pop("resume_from", None), run.pop("trainer", {})
    validate = run.pop("validate", spec.get("validate", False))
    if name.startswith("gpt"):
        run["plan"] = PLAN
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(**run),
        devices=spec["devices"],
        gradient_clip_val=spec["clip"],
        precision=precision,
        callbacks=[SaveAtTrainEnd(out / f"run{k}.ckpt")],
        **{**trainer_kwargs(spec["steps"]), **overrides},
    )
    with trainer.init_module(empty_init=True) if build == "meta" else contextlib.nullcontext():
        model = make()
    ckpt = str(out / f"run{resume_from}.ckpt") if resume_from is not None else None
    try:
        trainer.fit(model, data(name), ckpt_path=ckpt)
    except Exception as err:  # noqa: BLE001 - llama_none's fit is refused: recorded, the next run follows
        if name != "llama_none":
            raise
        caught = {"caught": f"{type(err).__name__}: {err}", "global_step": trainer.global_step}
        torch.save(caught, out / f"run{k}_rank{trainer.global_rank}.pt")
        continue
    record = {
        "losses": model.losses,
        "norms": model.norms,
        "hook_norms": model.hook_norms,
        "dtensor_parameters": getattr(model, "dtensor_parameters", None),
        "dtensor_mesh_dims": getattr(model, "dtensor_mesh_dims", None),
        "dtensor_outputs": getattr(model, "dtensor_outputs", None),
        "dtensor_names": getattr(model, "dtensor_names", None),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "coordinate": model.device_mesh.get_coordinate(),
        "stage": trainer.strategy.stage_index,
        "balance": trainer.strategy.balance_used,
        "state": {n: t.detach().clone() for n, t in model.state_dict().items()},
    }
    if build != "meta":  # the whole model, plain, on this process (stage-only: each rank holds its stage)
        record["after_fit"] = model(next(iter(data(name)))[0]).detach()
    if validate:  # the same trainer and module, from the checkpoint saved at the end of training
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
