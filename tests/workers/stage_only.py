"""Worker: the large-model path (meta-device build, stage-only materialization and loading).

Usage: python tests/workers/stage_only.py SPEC.json

Spec keys: out, kind, size (transformer or Llama config sizes), seed, batch, steps, lr, optimizer
("adam" or "sgd"), record ("tensors" or "stats": what each rank records of its stage's trained state).

- ``reference`` (one process, plain one-device Trainer): builds the whole model eagerly and
  records how much that raised the peak RSS (``whole_mb``); then either initializes it as the
  stages would (``init="stages"``: :func:`lightning_gpipe.state.materialize.initialize`) and trains
  ``steps``, or trains ``save_steps``, saves ``one.ckpt`` and then (``then``) resumes from it to
  ``steps`` (``"resume"``, default) or trains ``steps`` more from ``LazyNet.load_from_checkpoint``
  (``"load_from"``).
- otherwise (``devices`` ranks, gpipe): ``build`` is ``"init_module"`` (the module, its layers built
  in ``configure_model``, constructed under ``Trainer.init_module(empty_init=True)``),
  ``"init_module_eager"`` (layers built in ``__init__`` under it), ``"configure_model"`` (plain
  construction, layers in ``configure_model``) or ``"load_from"`` (``lightning_gpipe.
  load_from_checkpoint(LazyNet, load_from)``); ``ckpt`` resumes with ``ckpt_path=``.

``gpt_memory`` (sizes of :class:`tests.gpt.GPT`) runs :func:`gpt_memory` alone: the peak RSS of a
stage-only built plan model against the whole model's.

``gpt`` (``{"save_steps", "steps"}``) adds, in the same processes after that fit, the nanoGPT-style
model of :mod:`tests.gpt` pipelined by ``plan=PLAN`` (:func:`gpt_runs`): one device trains ``save_steps``
and saves ``gpt_one.ckpt``, then trains from it by Lightning's ``load_from_checkpoint`` (run
``load_from``) and by ``ckpt_path=`` (run ``resume``); 2 stages train ``save_steps`` from the same start
and save ``gpt_full.ckpt`` and ``gpt_sharded.ckpt`` (run ``save``), then, each rank building and loading
only its stage, train from ``lightning_gpipe.load_from_checkpoint(GPT, gpt_one.ckpt)`` (``load_from``) and
under ``Trainer.init_module(empty_init=True)`` with ``ckpt_path=`` each of the three checkpoints
(``resume_one``, ``resume_full``, ``resume_sharded``). Each run's record goes to
``gpt_{run}_rank{r}.pt``: its losses, the stage's state at ``on_train_start`` (``init``) and at the end
(``final``), and whether every layer of the other stages stayed on the meta device (``others_meta``).

Each process writes ``{name}_rank{r}.pt``: its stage's state at ``on_fit_start`` (``init``), at the
end of training (``final``), its losses, which of the whole Sequential's layers hold real tensors
after setup (``real_layers``, of those with parameters), and peak RSS growth in MB since just before
the model was built: after setup (``setup_mb``, at ``on_fit_start``) and after the weights were
loaded (``load_mb``, at the callbacks' ``on_load_checkpoint``). Peak RSS is the kernel's ``VmHWM``,
reset (``/proc/self/clear_refs``) just before the build; ``psutil`` gives the current RSS.
"""

import gc
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import Callback  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.state.materialize import has_meta, initialize  # noqa: E402
from tests.gpt import GPT, PLAN, gpt_data  # noqa: E402
from tests.models import LazyNet, build_lazy_layers, make_lazy_data, trainer_kwargs  # noqa: E402

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
kind, size, seed = spec["kind"], spec.get("size"), spec.get("seed", 0)
batch, steps, lr = spec.get("batch", 10), spec["steps"], spec.get("lr", 0.01)
optimizer = spec.get("optimizer", "adam")
record: dict = {"losses": []}
MB = 2**20


def reset_peak() -> float:
    """Reset the peak RSS to the current RSS; return the current RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return psutil.Process().memory_info().rss / MB


def peak() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def stage_state(module, how):
    """This stage's tensors (copies), or ``"stats"``: their sum and norm (one tensor at a time, no
    copy kept)."""
    state = {k: v for k, v in module.state_dict().items() if not v.is_meta}
    if how == "stats":
        return {k: (v.double().sum().item(), v.double().norm().item()) for k, v in state.items()}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


class Record(Callback):
    def __init__(self, baseline):
        self.baseline = baseline

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        record["load_mb"] = peak() - self.baseline

    def on_fit_start(self, trainer, pl_module):
        record["setup_mb"] = peak() - self.baseline
        if (
            spec.get("record", "tensors") == "tensors"
        ):  # ("stats" would raise the peak before the load is measured)
            record["init"] = stage_state(pl_module, "tensors")
        holding = [(k, layer) for k, layer in enumerate(pl_module.whole[0]) if list(layer.parameters())]
        record["real_layers"] = [k for k, layer in holding if not has_meta(layer)]

    def on_train_end(self, trainer, pl_module):
        record["final"] = stage_state(pl_module, spec.get("record", "tensors"))


if kind == "llama":  # transformers' imports and causal_lm's family check (cached) before any baseline:
    # the peaks below count the model's tensors, not the library's code
    build_lazy_layers(kind, {**size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2})


class GPTRecord(Callback):
    """A plan run's record: the stage's state at ``on_train_start`` (a ``ckpt_path=`` is loaded by then) and
    at the end, and whether the chain's layers of the other stages are still meta (each rank built and
    loaded only its stage)."""

    def __init__(self, run):
        self.run = run

    def on_train_start(self, trainer, pl_module):
        self.run["init"] = stage_state(pl_module, "tensors")
        installed = getattr(trainer.strategy, "_pipelined", None)
        if installed is not None and installed.installed is not None:
            held = set(pl_module.state_dict())
            chain = installed.installed.sequential.state_dict()
            self.run["others_meta"] = all(t.is_meta for k, t in chain.items() if k not in held)

    def on_train_end(self, trainer, pl_module):
        self.run["final"] = stage_state(pl_module, "tensors")


def gpt_runs(gpt, devices):
    """The plan runs of ``spec["gpt"]`` (module docstring), in this process; one record file per run."""
    save, steps = gpt["save_steps"], gpt["steps"]
    one, full, sharded = out / "gpt_one.ckpt", out / "gpt_full.ckpt", out / "gpt_sharded.ckpt"

    def fit(run, make, max_steps, ckpt_path=None, save_to=None, **strategy):
        pl.seed_everything(seed, verbose=False)
        record = {}
        kwargs = {**trainer_kwargs(max_steps), "max_epochs": 3, "callbacks": [GPTRecord(record)]}
        if devices == 1:
            trainer = pl.Trainer(devices=1, **kwargs)
        else:
            strategy = lightning_gpipe.GPipeStrategy(plan=PLAN, chunks=2, **strategy)
            trainer = pl.Trainer(strategy=strategy, devices=devices, **kwargs)
        model = make(trainer)
        trainer.fit(model, gpt_data(), ckpt_path=ckpt_path)
        for path in save_to or ():
            trainer.save_checkpoint(path)
            trainer.strategy.checkpoint_format = "sharded"  # the second one: the strategy's sharded format
        record["losses"] = model.losses
        torch.save(record, out / f"gpt_{run}_rank{trainer.global_rank}.pt")

    def on_meta(trainer):
        with trainer.init_module(empty_init=True):
            return GPT()

    if devices == 1:
        fit("save", lambda trainer: GPT(), save, save_to=[one])
        fit("load_from", lambda trainer: GPT.load_from_checkpoint(one), steps - save)
        fit("resume", lambda trainer: GPT(), steps, ckpt_path=one)
        return
    fit("save", lambda trainer: GPT(), save, save_to=[full, sharded], balance="time")
    stage_only = lambda trainer: lightning_gpipe.load_from_checkpoint(GPT, one)  # noqa: E731
    fit("load_from", stage_only, steps - save, balance=[3, 4])
    for run, path in (("resume_one", one), ("resume_full", full), ("resume_sharded", sharded)):
        fit(run, on_meta, steps, ckpt_path=path, balance="parameters")


class GPTMemory(Callback):
    """The peak RSS growth through setup (at ``on_fit_start``) of a stage-only built plan model, and how
    many of its parameters this rank holds real."""

    def __init__(self, baseline):
        self.baseline = baseline

    def on_fit_start(self, trainer, pl_module):
        record["setup_mb"] = peak() - self.baseline
        record["held"] = sum(p.numel() for p in pl_module.parameters() if not p.is_meta)


def gpt_memory(size, devices):
    """``spec["gpt_memory"]``: the nanoGPT-style model of :mod:`tests.gpt` at ``size``; one device builds it
    eagerly (``whole_mb``: what that raised the peak RSS by), ``devices`` ranks build it under
    ``Trainer.init_module(empty_init=True)`` and cut it by ``plan=PLAN`` (``balance="parameters"``); both
    train 2 steps."""
    loader = gpt_data(batch=4, steps=2, vocab=size["vocab"], length=size["length"])
    kwargs = {**trainer_kwargs(2), "max_epochs": 1}
    gc.collect()
    baseline = reset_peak()
    if devices == 1:
        pl.seed_everything(seed, verbose=False)
        model = GPT(size=size)
        record["whole_mb"] = peak() - baseline
        record["held"] = sum(p.numel() for p in model.parameters())
        pl.Trainer(devices=1, **kwargs).fit(model, loader)
        record["losses"] = model.losses
        torch.save(record, out / f"{spec['name']}_rank0.pt")
        return
    strategy = lightning_gpipe.GPipeStrategy(plan=PLAN, chunks=2, balance="parameters")
    trainer = pl.Trainer(strategy=strategy, devices=devices, callbacks=[GPTMemory(baseline)], **kwargs)
    with trainer.init_module(empty_init=True):
        model = GPT(size=size)
    trainer.fit(model, loader)
    record["losses"] = model.losses
    torch.save(record, out / f"{spec['name']}_rank{trainer.global_rank}.pt")


if "gpt_memory" in spec:
    gpt_memory(spec["gpt_memory"], spec["devices"])
    sys.exit(0)


def data():
    pl.seed_everything(seed, verbose=False)
    return make_lazy_data(kind, batch, max(steps, 1), size)


if spec.get("reference"):
    baseline = reset_peak()
    pl.seed_everything(seed, verbose=False)
    model = LazyNet(kind, lr, deferred=False, size=size, optimizer=optimizer)
    record["whole_mb"] = peak() - baseline
    plain = dict(devices=1, **{**trainer_kwargs(steps), "max_epochs": 3})
    if spec.get("init") == "stages":
        initialize(model.layers, seed)
        record["init"] = stage_state(model, "tensors")
        trainer = pl.Trainer(callbacks=[Record(baseline)], **plain)
        trainer.fit(model, data())
    else:
        trainer = pl.Trainer(**{**plain, "max_steps": spec["save_steps"]})
        trainer.fit(model, data())
        trainer.save_checkpoint(out / "one.ckpt")
        del model, trainer
        gc.collect()
        if spec.get("then") == "load_from":  # Lightning's own load_from_checkpoint, fresh optimizer
            model = LazyNet.load_from_checkpoint(out / "one.ckpt")
            pl.Trainer(callbacks=[Record(baseline)], **plain).fit(model, data())
        else:  # resume
            model = LazyNet(kind, lr, deferred=False, size=size, optimizer=optimizer)
            pl.Trainer(callbacks=[Record(baseline)], **plain).fit(model, data(), ckpt_path=out / "one.ckpt")
    record["losses"] = model.losses
    torch.save(record, out / f"{spec['name']}_rank0.pt")
    if "gpt" in spec:
        gpt_runs(spec["gpt"], 1)
    sys.exit(0)

strategy = lightning_gpipe.GPipeStrategy(chunks=spec.get("chunks", 2), balance=spec.get("balance"))
pl.seed_everything(seed, verbose=False)
gc.collect()
baseline = reset_peak()
trainer = pl.Trainer(
    strategy=strategy,
    devices=spec["devices"],
    callbacks=[Record(baseline)],
    **{**trainer_kwargs(steps), "max_epochs": 3},  # a resumed run continues in the next epoch
)
build = spec["build"]
if build == "init_module":
    with trainer.init_module(empty_init=True):
        model = LazyNet(kind, lr, deferred=True, size=size, optimizer=optimizer)
elif build == "init_module_eager":
    with trainer.init_module(empty_init=True):
        model = LazyNet(kind, lr, deferred=False, size=size, optimizer=optimizer)
elif build == "configure_model":
    model = LazyNet(kind, lr, deferred=True, size=size, optimizer=optimizer)
elif build == "load_from":
    model = lightning_gpipe.load_from_checkpoint(LazyNet, spec["load_from"])
else:
    raise ValueError(build)
trainer.fit(model, data(), ckpt_path=spec.get("ckpt"))
record["losses"] = model.losses
record["rss_mb"] = psutil.Process().memory_info().rss / MB
torch.save(record, out / f"{spec['name']}_rank{trainer.global_rank}.pt")
if "gpt" in spec:
    gpt_runs(spec["gpt"], spec["devices"])
print(f"worker rank {os.environ.get('LOCAL_RANK', '0')} done")
