"""Worker: train tests.models.Net under GPipeStrategy for each run in a JSON spec.

Usage: python tests/workers/train.py SPEC.json
Started once (Lightning's launcher re-runs this command for the other ranks) or once per rank
with RANK/WORLD_SIZE set (torchrun-style, as tests/conftest.py's gpipe_job does). Every rank writes
``run{k}_rank{r}.pt`` with what its module recorded (losses, gradients, clipped gradients,
norms, sample indices, callback metrics, best checkpoint path, stop epoch); rank 0 (a last
stage) also writes the full trained state.

A run may carry, for that run only: "net" (Net kwargs), "trainer" (Trainer kwargs), "features"
(tests.models.feature_callbacks names; a "stop_probe"'s records come back as "stop_probe"),
"record_logs" (a Recorder logger), "example_input" (example_input_array set), "predict_only" (no
fit: predict on ``predict_samples`` samples), "validate" (trainer.validate after fit), "fit" (false:
no fit), "caught" (the fit's exception is caught: its type and message come back as "caught"),
"missing_ckpt" (fit from a checkpoint path that does not exist: every rank fails), "profiler"
("simple", "advanced" or "pytorch": reports in ``out/profiles``).
Spec keys: namespace ("pytorch_lightning" or "lightning.pytorch"), kind, devices, runs
(GPipeStrategy kwargs per run; "{k}" in save/resume paths is the run index), steps, batch, seed, lr,
samples, net (Net kwargs), trainer (extra Trainer kwargs), val, val_samples, callbacks
({"checkpoint": ModelCheckpoint kwargs, "early_stopping": EarlyStopping kwargs}), save (checkpoint
file to write after fit; "{k}" is the run's index), save_at_train_end (written inside fit, "{k}" as
in save, while the model is partitioned), atomic_check (then a failing save to the same path), fit
(false: skip the first fit), exit_check (write exit_rank{r}.json: process group and threads left at
exit), resume ({"ckpt": path, "steps": total steps, "trainer": overrides}), predict (trainer.predict
after fit), shuffle (the training loader shuffles), rank0_only ({"at": batch, "call": "save" |
"barrier" | "broadcast" | "agree", "sigterm_after": seconds, "signal": "SIGTERM" (default) |
"SIGINT"}: only global rank 0 calls it, after writing the file "blocked" (and arranging that signal
to itself)), fail_in ({"hook": a Callback hook name, "rank": r}: that hook raises ValueError on global
rank r only, outside sanity checking), planted ({"kind": Net kind, "path": checkpoint}: after the
runs, a fit(ckpt_path=path) of a fresh Net(kind) for 2 steps, its error (type and message, or
None) written to refused_rank{r}.json and printed; then, in the same process, a fit of another fresh
Net(kind) for 2 steps without a checkpoint, whose weights rank 0 saves to after_refusal.pt),
record_start_state
(rank 0 records the full state as training starts; every rank also records, just before fit, its
module's state as "init_state" and its torch CPU generator state as "init_rng"). Every rank records
its module's ``device_mesh`` after fit as "mesh" (:func:`mesh_record`). seed: the seed_everything
seed (default 0); None: an unseeded script, no seed_everything (PL_GLOBAL_SEED removed): each process
draws its torch, random and numpy generators from OS entropy, so every process initializes different
weights and holds a different random state.
"""

import atexit
import importlib
import json
import os
import sys
from pathlib import Path

import torch

spec = json.loads(Path(sys.argv[1]).read_text())
if spec.get("rank0_only", {}).get("signal") == "SIGINT":
    import signal

    # as in a terminal, where Ctrl-C reaches the job: a shell that starts a job in the background
    # (`cmd &`, nohup) has it ignore SIGINT, which the job's ranks (started from this one) inherit
    signal.signal(signal.SIGINT, signal.default_int_handler)
# "pytorch_lightning" (default) or "lightning.pytorch": the Trainer, module and callbacks all come from it
os.environ["GPIPE_TEST_LIGHTNING"] = spec.get("namespace", "pytorch_lightning")
pl = importlib.import_module(os.environ["GPIPE_TEST_LIGHTNING"])
Callback, EarlyStopping, ModelCheckpoint = (
    pl.Callback,
    pl.callbacks.EarlyStopping,
    pl.callbacks.ModelCheckpoint,
)

import lightning_gpipe  # noqa: E402
from lightning_gpipe import _compat  # noqa: E402
from tests.models import Net, Recorder, feature_callbacks, make_data, trainer_kwargs  # noqa: E402

torch.set_num_threads(1)
out = Path(spec["out"])
net_kwargs = dict(spec.get("net", {}))
for key in ("record_grads", "record_params", "call_twice", "fail", "slow", "wrong_shape"):
    if key in spec:
        net_kwargs[key] = spec[key]
steps, batch, kind = spec.get("steps", 5), spec.get("batch", 10), spec["kind"]
if spec.get("exit_check"):  # registered first, so it runs after the strategy's own exit hook
    _exit_path = out / f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.json"

    def _record_exit_state(path=_exit_path):
        import threading
        import time

        # a native thread that is ending (a store connection the heartbeat closed) may take a moment;
        # one that is still there after 2 s is what the test looks for
        deadline = time.monotonic() + 2.0
        while len(os.listdir("/proc/self/task")) != threading.active_count() and time.monotonic() < deadline:
            time.sleep(0.05)
        state = {
            "initialized": torch.distributed.is_initialized(),
            "os_threads": len(os.listdir("/proc/self/task")),
            "python_threads": [t.name for t in threading.enumerate()],
        }
        path.write_text(json.dumps(state))

    atexit.register(_record_exit_state)
indexed = net_kwargs.get("indexed", False)
extra: dict = {}


def trainer_for(run, max_steps, callbacks=(), overrides=None):
    kwargs = {
        **trainer_kwargs(max_steps),
        **spec.get("trainer", {}),
        **run.pop("trainer", {}),
        **(overrides or {}),
    }
    if run.pop("record_logs", False):
        kwargs["logger"] = Recorder()
    profiler = run.pop(
        "profiler", None
    )  # "simple" | "advanced" | "pytorch": a report file per rank in out/profiles
    if profiler is not None:
        kinds = {
            "simple": pl.profilers.SimpleProfiler,
            "advanced": pl.profilers.AdvancedProfiler,
            "pytorch": pl.profilers.PyTorchProfiler,
        }
        kwargs["profiler"] = kinds[profiler](dirpath=out / "profiles", filename=profiler)
    strategy = lightning_gpipe.GPipeStrategy(**run)
    return pl.Trainer(strategy=strategy, devices=spec["devices"], callbacks=list(callbacks), **kwargs)


def train_data():
    return make_data(
        kind,
        batch,
        max(steps, 5),
        indexed=indexed,
        samples=spec.get("samples", batch * 5),
        shuffle=spec.get("shuffle", False),
    )


class RecordStartState(Callback):
    """The whole Sequential's state as training starts (gathered from every stage onto rank 0)."""

    def on_train_start(self, trainer, pl_module):
        extra["start_state"] = {
            k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()
        }


class SaveAtTrainEnd(Callback):
    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)
        if spec.get("atomic_check"):  # a failing second save must leave the first one intact
            try:
                trainer.strategy.save_checkpoint({"bad": lambda: None}, self.path)
            except Exception as err:  # noqa: BLE001
                extra["atomic_error"] = type(err).__name__


class Rank0Only(Callback):
    """At batch ``at``, global rank 0 alone saves a checkpoint, enters a barrier, broadcasts or calls
    reduce_boolean_decision (writes ``blocked`` first)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        what = spec["rank0_only"]
        if trainer.is_global_zero and batch_idx == what["at"]:
            (out / "blocked").write_text("1")
            if what.get("sigterm_after"):  # as a scheduler, `timeout` or Ctrl-C would, rank 0 blocked
                import signal
                import threading

                signum = getattr(signal, what.get("signal", "SIGTERM"))
                threading.Timer(what["sigterm_after"], os.kill, (os.getpid(), signum)).start()
            if what["call"] == "save":
                trainer.save_checkpoint(out / "only0.ckpt")
            elif what["call"] == "broadcast":
                trainer.strategy.broadcast("only rank 0")
            elif what["call"] == "agree":
                trainer.strategy.reduce_boolean_decision(True)
            else:
                trainer.strategy.barrier("only rank 0")


class FailIn(Callback):
    """Raise ``ValueError("injected failure in HOOK")`` in the Callback hook ``spec["fail_in"]["hook"]``
    on global rank ``spec["fail_in"]["rank"]`` only."""

    def __init__(self, hook: str, rank: int) -> None:
        def fail(trainer, *args, **kwargs):
            if trainer.global_rank == rank and not trainer.sanity_checking:
                raise ValueError(f"injected failure in {hook}")

        setattr(self, hook, fail)


def mesh_record(trainer, model) -> dict | None:
    """The module's device mesh after fit: dimension names, sizes, this rank's coordinates, and
    every dimension's process-group ranks and mesh slice; ``None`` without one."""
    mesh = model.device_mesh
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    return {
        "names": names,
        "shape": tuple(mesh.shape),
        "stage": trainer.strategy.stage_index,
        "is_strategy_mesh": trainer.strategy.device_mesh is mesh,
        "coordinate": mesh.get_coordinate(),
        "local_rank": {n: mesh.get_local_rank(n) for n in names},
        "group_ranks": {n: torch.distributed.get_process_group_ranks(mesh.get_group(n)) for n in names},
        "slice": {n: mesh[n].mesh.tolist() for n in names},
    }


for k, run in enumerate(spec["runs"]):
    run = dict(run)
    run_net = {**net_kwargs, **run.pop("net", {})}  # a run's own Net options
    if spec.get("seed", 0) is None:  # unseeded: every process starts from its own random state
        import random

        import numpy as np

        os.environ.pop("PL_GLOBAL_SEED", None)
        torch.seed()
        random.seed()
        np.random.seed()
    else:
        pl.seed_everything(spec.get("seed", 0), verbose=False)
    model = Net(kind, lr=spec.get("lr", 0.1), **run_net)
    if run.pop("example_input", False):
        model.example_input_array = torch.zeros(2, 6)
    predict_only = run.pop("predict_only", False)
    validate_after = run.pop(
        "validate", False
    )  # trainer.validate(model, val) after fit (or instead: "fit": False)
    fit_run = run.pop("fit", True)
    caught = run.pop("caught", False)  # the fit is expected to fail: caught, and the next run follows
    missing_ckpt = run.pop("missing_ckpt", False)  # fit(ckpt_path=<no such file>): every rank fails
    callbacks: list = feature_callbacks(run.pop("features", {}))
    if "checkpoint" in spec.get("callbacks", {}):
        callbacks.append(ModelCheckpoint(dirpath=out / f"ckpt{k}", **spec["callbacks"]["checkpoint"]))
    if "early_stopping" in spec.get("callbacks", {}):
        callbacks.append(EarlyStopping(**spec["callbacks"]["early_stopping"]))
    if spec.get("rank0_only"):
        callbacks.append(Rank0Only())
    if spec.get("fail_in"):
        callbacks.append(FailIn(spec["fail_in"]["hook"], spec["fail_in"]["rank"]))
    if spec.get("record_start_state"):
        callbacks.append(RecordStartState())
    if spec.get("save_at_train_end"):
        callbacks.append(SaveAtTrainEnd(out / spec["save_at_train_end"].format(k=k)))
    val = None
    if spec.get("val"):
        val = make_data(kind, batch, 2, seed=2, indexed=indexed, samples=spec.get("val_samples"))
    trainer = trainer_for(run, steps, callbacks)
    if spec.get("record_start_state"):  # this process's own start, before the strategy touches it
        extra["init_state"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        extra["init_rng"] = torch.get_rng_state()
    caught_error = None
    if spec.get("fit", True) and not predict_only and fit_run:
        try:
            trainer.fit(
                model, train_data(), val, ckpt_path=str(out / "missing.ckpt") if missing_ckpt else None
            )
        except Exception as err:  # noqa: BLE001 - a retry loop's catch
            if not caught:
                raise
            caught_error = f"{type(err).__name__}: {err}"
    if validate_after:
        extra["validated"] = trainer.validate(model, make_data(kind, batch, 2, seed=2), verbose=False)
    checkpoint_cb = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
    layers = model.layers  # the user's torch.compile wrapper is back after fit: iterate what it compiles
    if isinstance(layers, _compat.OptimizedModule):
        layers = _compat.compiled_module(layers)
    record = {
        "strategy_class": next(  # the Lightning base the strategy became (its namespace)
            k.__module__
            for k in type(trainer.strategy).__mro__
            if not k.__module__.startswith("lightning_gpipe")
        ),
        "stage_compiled": getattr(model, "stage_compiled", None),
        "chunks_used": getattr(trainer.strategy, "chunks_used", None),
        "logged": getattr(trainer.logger, "logged", None),
        "losses": model.losses,
        "synced_losses": model.synced_losses,
        "shapes": model.shapes,
        "grads": model.grads,
        "clipped": model.clipped,
        "norms": model.norms,
        "indices": model.indices,
        "pre_draws": model.pre_draws,
        "callback_metrics": {m: v.item() for m, v in trainer.callback_metrics.items()},
        "best_model_path": checkpoint_cb.best_model_path if checkpoint_cb else None,
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "lrs": model.lrs,
        "params": model.params,
        "step_lrs": model.step_lrs,
        "received_skips": getattr(trainer.strategy, "last_received_skips", None),
        "effects": {k: layer.effects() for k, layer in enumerate(layers) if hasattr(layer, "effects")},
        "stop_probe": next((c.seen for c in callbacks if hasattr(c, "seen")), None),
        "rng_after": torch.rand(4),
        "caught": caught_error,
        "mesh": mesh_record(trainer, model),
    }
    if spec.get("save"):
        trainer.save_checkpoint(out / spec["save"].format(k=k))
    if spec.get("predict") or predict_only:
        record["predictions"] = trainer.predict(
            model,
            make_data(
                kind,
                spec.get("predict_batch", batch),
                2,
                seed=2,
                indexed=indexed,
                samples=spec.get("predict_samples"),
            ),
        )
        record["written"] = [
            (c.batches, c.epoch)
            for c in trainer.callbacks
            if hasattr(c, "write_on_batch_end") and hasattr(c, "epoch")
        ]
    if spec.get("resume"):
        model = Net(kind, lr=spec.get("lr", 0.1), **run_net)
        trainer = trainer_for(run, spec["resume"]["steps"], overrides=spec["resume"].get("trainer"))
        trainer.fit(model, train_data(), ckpt_path=spec["resume"]["ckpt"].format(k=k))
        record["resumed_losses"] = model.losses
        record["resumed_global_step"] = trainer.global_step
    record.update(extra)
    rank = trainer.global_rank
    if rank == 0:
        record["state"] = {n: t.clone() for n, t in model.state_dict().items()}
    torch.save(record, out / f"run{k}_rank{rank}.pt")
if spec.get("planted"):  # as a user's script would: fit(ckpt_path=...) from a planted checkpoint
    planted = spec["planted"]
    pl.seed_everything(0, verbose=False)
    model = Net(planted["kind"], lr=spec.get("lr", 0.1))
    trainer = trainer_for({"chunks": 2}, 2)
    try:
        trainer.fit(model, make_data(planted["kind"], batch, 2), ckpt_path=planted["path"])
        refused = None
    except Exception as err:  # noqa: BLE001 - recorded for the test, whatever it is
        refused = f"{type(err).__name__}: {err}"
        print(refused, file=sys.stderr, flush=True)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    (out / f"refused_rank{rank}.json").write_text(json.dumps(refused))
    pl.seed_everything(0, verbose=False)  # then a fit without it, in the same process
    model = Net(planted["kind"], lr=spec.get("lr", 0.1))
    trainer = trainer_for({"chunks": 2}, 2)
    trainer.fit(model, make_data(planted["kind"], batch, 5))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / "after_refusal.pt")
print(f"worker rank {os.environ.get('LOCAL_RANK', '0')} done")
