"""Worker: a pipelined fit that a signal or a SIGKILL interrupts, as a scheduler or the OOM killer would.

Usage: python tests/workers/faults.py SPEC.json
Started once (Lightning's launcher re-runs this command for the other ranks) or once per rank
with RANK/WORLD_SIZE set (torchrun-style). tests.models.Net ("mlp", lr 0.1, seed 0) trains on one
batch of 10 samples per epoch (so every step boundary is an epoch's start) for ``steps`` steps,
with Lightning's ``OnExceptionCheckpoint`` writing ``OUT/on_exception.ckpt``.

Spec keys: out, devices, steps, strategy (GPipeStrategy kwargs), val (a validation loader of 2
batches), every_step_checkpoint (ModelCheckpoint after every step, in OUT/ckpts), and one fault:

- ``signal``: ``{"rank": r, "at": step, "name": "SIGTERM" | "SIGINT", "to": "self" | "group" |
  "launcher-group", "during": "step" | "validation" | "save"}``: global rank ``r`` (``"all"``: every
  rank) sends the signal to itself, to its whole process group (``os.killpg``, as SLURM or
  Kubernetes signal a job), or to the process group of the process that started it (torchrun's
  agent, whose workers lead sessions of their own), once
  ``global_step == at``: at the end of that training batch, in the validation after it, or while
  the checkpoint of that step is saved.
- ``kill_in_save``: ``{"at": step, "replace": n, "when": "before" | "after"}`` or ``{"at": step,
  "writing": true}``: every step ends in ``trainer.save_checkpoint(OUT/c.ckpt)``; in the save of step
  ``at``, the rank that reaches the point (rank 0, which commits) SIGKILLs every rank of the job
  (each leads a process group; their pids are in OUT/pid{r}), itself last: before or after the
  ``n``-th ``os.replace`` of that save, or (``writing``) once half the staged file is written.
  OUT/killed says where.
- ``kill``: ``{"layer": i, "call": n}``: the rank holding layer ``i`` kills itself with SIGKILL in
  that layer's ``n``-th forward call (during the forward), writing OUT/died (its rank and the time)
  first; or ``{"rank": r, "at": step, "during": "save"}``: rank ``r`` kills itself at the end of
  batch ``at`` while every other rank saves a checkpoint there (they wait for it in the gather).

Every rank writes OUT/rank{r}.json: how ``fit`` ended (the exception's type, exit code and message),
the global step and the time.
"""

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

import lightning_gpipe
from tests.models import Net, make_data, trainer_kwargs

spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
torch.set_num_threads(1)
if spec.get("signal", {}).get("name") == "SIGINT":  # as in a terminal (a background job ignores SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _send(name: str, to: str) -> None:
    signum = getattr(signal, name)
    if to == "group":
        os.killpg(os.getpgid(0), signum)
    elif to == "launcher-group":
        os.killpg(os.getpgid(os.getppid()), signum)
    else:
        os.kill(os.getpid(), signum)


def _die(rank: int) -> None:
    (out / "died").write_text(json.dumps({"rank": rank, "time": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)


class Fault(pl.Callback):
    def __init__(self) -> None:
        self.sent = False

    def _signal(self, trainer, during: str) -> None:
        what = spec.get("signal")
        if (
            what
            and not self.sent
            and what.get("during", "step") == during
            and what["rank"] in ("all", trainer.global_rank)
            and trainer.global_step == what["at"]
        ):
            self.sent = True
            _send(what["name"], what.get("to", "self"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._signal(trainer, "step")
        if "kill_in_save" in spec:
            if trainer.global_step == spec["kill_in_save"]["at"]:
                arm_kill_in_save(spec["kill_in_save"])
            trainer.save_checkpoint(out / "c.ckpt")
        kill = spec.get("kill", {})
        if kill.get("during") == "save" and trainer.global_step == kill["at"]:
            if trainer.global_rank == kill["rank"]:
                _die(trainer.global_rank)
            trainer.save_checkpoint(out / "gathered.ckpt")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._signal(trainer, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._signal(trainer, "save")


def _kill_job(where: str) -> None:
    """SIGKILL every rank of the job (the others first), as a node failure or a scheduler would."""
    (out / "killed").write_text(where)
    pids = [int(p.read_text()) for p in sorted(out.glob("pid*"))]
    for pid in sorted(pids, key=lambda p: p == os.getpid()):
        os.killpg(pid, signal.SIGKILL)


def arm_kill_in_save(what: dict) -> None:
    """Make this rank kill the job at the point of the next save that ``what`` names."""
    if what.get("writing"):
        real_save = torch.save

        def half_save(obj, target, *args, **kwargs):
            real_save(obj, target, *args, **kwargs)
            if ".tmp-" in str(target):  # the staged file, not one the user names
                with open(target, "r+b") as handle:
                    handle.truncate(os.path.getsize(target) // 2)
                _kill_job(f"writing {target}")

        torch.save = half_save
        return
    real_replace, calls = os.replace, [0]

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == what["replace"] and what["when"] == "before":
            _kill_job(f"before os.replace({src}, {dst})")
        real_replace(src, dst)
        if calls[0] == what["replace"] and what["when"] == "after":
            _kill_job(f"after os.replace({src}, {dst})")

    os.replace = replace


def kill_in_forward(model: Net, trainer: pl.Trainer, layer: int, call: int) -> None:
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == call:
            _die(trainer.global_rank)

    model.layers[layer].register_forward_pre_hook(hook)


tempfile.tempdir = None  # $TMPDIR as this job's environment sets it (a fork server may have cached its own)
(out / f"pid{os.environ.get('RANK', os.environ.get('LOCAL_RANK', '0'))}").write_text(str(os.getpid()))
pl.seed_everything(0, verbose=False)
model = Net("mlp", lr=0.1)
callbacks = [pl.callbacks.OnExceptionCheckpoint(dirpath=out, filename="on_exception"), Fault()]
if spec.get("every_step_checkpoint"):
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=1))
kwargs = {**trainer_kwargs(spec["steps"]), "max_epochs": -1, "enable_checkpointing": True}
trainer = pl.Trainer(
    strategy=lightning_gpipe.GPipeStrategy(**spec.get("strategy", {})),
    devices=spec["devices"],
    callbacks=callbacks,
    **kwargs,
)
if "layer" in spec.get("kill", {}):
    kill_in_forward(model, trainer, spec["kill"]["layer"], spec["kill"]["call"])
train = make_data("mlp", 10, max(spec["steps"], 5), samples=10)
val = make_data("mlp", 10, 2, seed=2) if spec.get("val") else None
ended = {"type": None, "code": 0, "message": ""}
try:
    trainer.fit(model, train, val)
except BaseException as err:
    ended = {"type": type(err).__name__, "code": getattr(err, "code", None), "message": str(err)}
    raise
finally:
    ended.update(global_step=trainer.global_step, time=time.time())
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(ended))
print(f"worker rank {trainer.global_rank} done")
