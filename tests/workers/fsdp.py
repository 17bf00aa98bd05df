"""Worker: a small decoder-only Transformer trained under ``GPipeStrategy(data_parallel="fsdp")``, several
fits in one launch (issue 42, item 2).

Usage: python tests/workers/fsdp.py SPEC.json (every rank, torchrun-style: ``tests._harness.run_ranks``).

Spec keys: out, devices, size (``build_transformer`` sizes), batch (per replica), steps, lr, clip
(``gradient_clip_val``), full_batch (the data set is one batch of ``batch`` samples per replica: every
step is an epoch over the same samples, however many replicas share them), runs (GPipeStrategy kwargs per
run; a run may carry ``save``: a checkpoint path to write at the end of training, the stages still
sharded, ``resume``: a path to fit from, ``steps``: the steps in all, for this run, ``tied``: the model's
LM head tied to its token embedding, ``build_lazy_layers``, ``precision``: the Trainer's, and ``hooks``:
the module records Lightning's ``grad_norm(self)`` total in ``on_before_optimizer_step`` and clips by hand,
``clip_grad_norm_(self.parameters(), clip)`` in ``configure_gradient_clipping``, ``none_at`` and ``nan_at``:
``training_step`` returns ``None``, or its loss times NaN, at that global step; a fit that raises is
recorded as ``caught``), stage_only (the
layers built in ``configure_model`` under ``Trainer.init_module(empty_init=True)``: each rank
materializes its stage only; no trained state is written).

Each rank writes ``run{k}_rank{r}.pt``: its losses (last stages), the global step, the gradient norm
before clipping of every step (``hooks``: the hand clip's), ``grad_norm(self)``'s totals (``hooks``),
how many gradient reduce-scatters and split backwards' weight passes it
ran, what its stage holds at the end of training (the class names of its blocks, whether its parameters
are ``DTensor`` shards, their local and whole element counts, the optimizer state's local element count)
and the class names of the Sequential's modules after fit; rank 0 also writes the whole trained state
(the Sequential is whole again after fit).
"""

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.utilities import grad_norm  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.engine.backward_split import Split  # noqa: E402
from tests.models import LazyNet, OddStepNet, make_lazy_data, trainer_kwargs  # noqa: E402

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
reduce_scatters = [
    0
]  # FSDP2's gradient reductions on this rank (one per block and step, not per micro-batch)
_reduce_scatter = torch.distributed.reduce_scatter_single


def counted_reduce_scatter(*args, **kwargs):
    reduce_scatters[0] += 1
    return _reduce_scatter(*args, **kwargs)


torch.distributed.reduce_scatter_single = counted_reduce_scatter
weight_passes = [0]  # backwards split into input and weight gradients whose weight pass ran (zb_h1)
_weights = Split.weights


def counted_weights(self):
    weight_passes[0] += 1
    return _weights(self)


Split.weights = counted_weights


class Holdings(pl.Callback):
    """What this rank's stage and optimizer hold at the end of training; every step's gradient norm before
    clipping (``GPipeStrategy.last_grad_norm``)."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.strategy.last_grad_norm is not None:
            self.norms.append(float(trainer.strategy.last_grad_norm))

    def on_train_end(self, trainer, pl_module):
        params = list(pl_module.layers.parameters())
        state = trainer.optimizers[0].state.values()
        tensors = [t for s in state for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        self.seen = {
            "classes": [type(m).__name__ for m in pl_module.layers.children()],
            "dtensor": [isinstance(p, DTensor) for p in params],
            "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
            "whole": sum(p.numel() for p in params),
            "optimizer_local": sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors),
        }


class HookedNet(LazyNet):
    """:class:`LazyNet` whose gradient hooks use the whole model (issue 40): ``grad_norm(self)``'s total in
    ``on_before_optimizer_step`` (``hook_norms``), and a hand ``clip_grad_norm_(self.parameters(), c)`` in
    ``configure_gradient_clipping`` in place of Lightning's (its total norms in ``clip_norms``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hook_norms: list[float] = []
        self.clip_norms: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        self.hook_norms.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
        self.clip_norms.append(float(norm))


class SaveAtTrainEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` at the end of training, while the stages are still sharded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


for k, run in enumerate(spec["runs"]):
    run = dict(run)
    save, resume, steps = run.pop("save", None), run.pop("resume", None), run.pop("steps", spec["steps"])
    size = {**spec["size"], "tied": run.pop("tied", False)}
    net, precision = HookedNet if run.pop("hooks", False) else LazyNet, run.pop("precision", "32-true")
    odd = {key: run.pop(key) for key in ("none_at", "nan_at") if key in run}
    if odd:
        net = functools.partial(OddStepNet, **odd)
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    holdings = Holdings()
    callbacks = [holdings, *([SaveAtTrainEnd(save)] if save else [])]
    kwargs = {**trainer_kwargs(steps), "gradient_clip_val": spec.get("clip"), "precision": precision}
    if spec.get("full_batch"):  # every step one whole epoch: the same samples at any data-parallel size
        kwargs["max_epochs"] = steps
    trainer = pl.Trainer(
        strategy=lightning_gpipe.GPipeStrategy(**run), devices=spec["devices"], callbacks=callbacks, **kwargs
    )
    if spec.get("stage_only"):  # built on the meta device: each rank materializes its stage only
        with trainer.init_module(empty_init=True):
            model = net("transformer", lr=spec.get("lr", 0.01), size=size)
    else:
        model = net("transformer", lr=spec.get("lr", 0.01), deferred=False, size=size)
    # the one-device batches, each split over the D replicas (Lightning's DistributedSampler)
    replicas = trainer.strategy.layout.replicas
    batches = replicas if spec.get("full_batch") else steps * replicas
    data = make_lazy_data("transformer", spec["batch"], batches, spec["size"])
    caught = None
    try:
        trainer.fit(model, data, ckpt_path=resume)
    except Exception as err:  # noqa: BLE001 - a run expected to fail (none_at): recorded, the next run follows
        if not odd:
            raise
        caught = f"{type(err).__name__}: {err}"
    record = {
        "caught": caught,
        "losses": model.losses,
        "global_step": trainer.global_step,
        "norms": getattr(model, "clip_norms", holdings.norms),
        "hook_norms": getattr(model, "hook_norms", None),
        **holdings.seen,
    }
    record["reduce_scatters"], reduce_scatters[0] = reduce_scatters[0], 0
    record["weight_passes"], weight_passes[0] = weight_passes[0], 0
    record["after"] = [type(m).__name__ for m in model.layers.modules()]  # the whole Sequential after fit
    if trainer.global_rank == 0 and not spec.get("stage_only"):
        record["state"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    torch.save(record, out / f"run{k}_rank{trainer.global_rank}.pt")
print("worker done")
