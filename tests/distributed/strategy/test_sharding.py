"""Sharded data parallel per stage (``data_parallel="fsdp"``, issue 42 item 2) equals one device (CPU, Gloo,
hard timeouts)."""

import json
import math

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_gpipe.state.safe_reader import SafeReader
from lightning_gpipe.state.sharded import load_sharded, set_sharded_optimizer_states
from tests._harness import check, run_ranks
from tests.conftest import max_diff
from tests.models import LazyNet, OddStepNet, make_lazy_data, trainer_kwargs

SIZE = {"vocab_size": 32, "num_layers": 4, "d_model": 32, "num_heads": 2, "d_ff": 64, "seq_len": 16}
LR, CLIP, STEPS = 0.001, 0.1, 4


def replicas_order(replicas: int, batch: int, steps: int) -> list[int]:
    """The sample order one device sees where ``replicas`` replicas take ``batch`` samples a step each: step
    s's batch is every replica's s-th batch, concatenated. With D > 1 Lightning's DistributedSampler
    shuffles as under DDP (seed 0, epoch 0), computed here independently."""
    n = replicas * batch * steps
    shards = [list(DistributedSampler(range(n), replicas, r, shuffle=True, seed=0)) for r in range(replicas)]
    if replicas == 1:
        shards = [list(range(n))]
    return [i for s in range(steps) for shard in shards for i in shard[s * batch : (s + 1) * batch]]


class GradNorms(pl.Callback):
    """The gradient norm of the whole model before clipping, every step (one device)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def one_device(
    order: list[int],
    batch: int,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    tied: bool = False,
    precision: str = "32-true",
    nan_at: int | None = None,
) -> LazyNet:
    """The reference: the same module (seed 0; ``tied``: its LM head tied to its token embedding) on one
    device, Adam, clipped at ``CLIP``, the worker's samples in ``order``, ``batch`` a step, in ``precision``
    (``nan_at``: the loss times NaN at that step, :class:`OddStepNet`); its gradient norms before clipping in
    ``model.norms``."""
    pl.seed_everything(0, verbose=False)
    model = OddStepNet("transformer", lr=LR, deferred=False, size={**SIZE, "tied": tied}, nan_at=nan_at)
    norms = GradNorms()
    model.norms = norms.norms
    trainer = pl.Trainer(
        devices=1, gradient_clip_val=CLIP, callbacks=[norms], precision=precision, **trainer_kwargs(steps)
    )
    x, y = make_lazy_data("transformer", batch, len(order) // batch, SIZE).dataset.tensors
    data = DataLoader(TensorDataset(x[order], y[order]), batch_size=batch)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model


def fsdp_job(
    tmp_path, devices: int, runs: list[dict], batch: int, steps: int = STEPS, **extra
) -> list[list[dict]]:
    """Run tests/workers/fsdp.py over ``devices`` ranks (``extra``: more spec keys); per run, every rank's
    record."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(tmp_path), "devices": devices, "size": SIZE, "batch": batch, "steps": steps, **extra}
    spec.update(lr=LR, clip=CLIP, runs=runs)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    for result in run_ranks("tests/workers/fsdp.py", devices, str(path), timeout=240):
        check(result)
    return [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(devices)]
        for k in range(len(runs))
    ]


def step_losses(losses_by_replica: list[list[float]], calls: int = 1) -> list[float]:
    """Per step, the mean of the replicas' losses (each over its share of the batch), ``calls`` losses a step
    on each (schedules other than gpipe: ``training_step`` once per micro-batch, of equal sizes here)."""
    steps = [
        [sum(losses[k : k + calls]) / calls for k in range(0, len(losses), calls)]
        for losses in losses_by_replica
    ]
    return [sum(step) / len(step) for step in zip(*steps)]


@pytest.mark.timeout(300)
def test_pipeline_times_fsdp_matches_single_device(tmp_path):
    """K=2 stages × D=2 FSDP replicas (4 processes): gpipe, 1f1b, interleaved_1f1b and zb_h1 (every backward
    split into input and weight gradients, the gradients reduce-scattered after the step's last weight
    pass), and 1f1b, zb_h1 (checkpoint="except_last": the last micro-batch's backward split) and
    interleaved_1f1b with the LM head tied to the token embedding across the two stages (GPT-2's tie: each
    stage's copy sharded on its own, the tied gradients summed shard by shard), 1f1b with the gradient hooks
    on the whole model (issue 40: Lightning's ``grad_norm(self)`` in ``on_before_optimizer_step`` and a hand
    ``clip_grad_norm_(self.parameters(), c)`` in ``configure_gradient_clipping``, the parameters whole copies
    of the shards, the clip written back into the sharded gradients) and gpipe under ``balance="memory"``,
    each 4 steps of Adam with gradient clipping by the global norm, equal one device on the concatenated
    batch (≤ 1e-5 on the losses, the norms and the trained weights); ``bf16-mixed`` within 5e-3 of one
    device's bf16-mixed losses, after a fit whose step 1 had a NaN loss (NaN on every rank, as on one device)
    and one whose ``training_step`` returned ``None`` (refused on every rank after the same step). Each rank
    holds half its stage's parameters and optimizer state, as DTensor shards; each block's gradients are
    reduce-scattered once a step, not once per micro-batch; and after fit the Sequential is whole and
    unwrapped again."""
    mesh = {"chunks": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2, "data_parallel": "fsdp"}
    schedules = [
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zb_h1",
        "1f1b",
        "1f1b",
        "gpipe",
        "zb_h1",
        "interleaved_1f1b",
    ]
    never, last, tied = {"checkpoint": "never"}, {"checkpoint": "except_last"}, {"tied": True}
    # zb_h1 splits unrecomputed backwards only
    extra = [{}, {}, {}, never, tied, {"hooks": True}, {"balance": "memory"}, {**last, **tied}, tied]
    runs = [{**mesh, "schedule": s, **e} for s, e in zip(schedules, extra)]
    odd = [{**mesh, "schedule": "1f1b", "nan_at": 1}, {**mesh, "none_at": 1}]  # then bf16, same processes
    runs = fsdp_job(tmp_path, 4, [*runs, *odd, {**mesh, "precision": "bf16-mixed"}], batch=4)
    order = replicas_order(2, 4, STEPS)
    references = {tied: one_device(order, batch=8, tied=tied) for tied in (False, True)}
    for schedule, e, ranks in zip(schedules, extra, runs):
        reference, what = references[bool(e.get("tied"))], (schedule, e)
        # ranks 0 and 2 run the last stage of replicas 0 and 1 (the layout's formula)
        losses = step_losses([ranks[0]["losses"], ranks[2]["losses"]], 1 if schedule == "gpipe" else 2)
        assert len(losses) == STEPS, what
        assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5, what
        assert max_diff(ranks[0]["state"], reference.state_dict()) <= 1e-5, what
        assert min(reference.norms) > CLIP  # every step clipped, by the whole model's norm on every rank
        assert all(max(abs(a - b) for a, b in zip(r["norms"], reference.norms)) <= 1e-5 for r in ranks), what
        if e.get("hooks"):  # grad_norm(self) and a hand clip_grad_norm_(self.parameters()): the whole model
            for r in ranks:
                assert len(r["hook_norms"]) == len(r["norms"]) == STEPS
                assert max(abs(a - b) for a, b in zip(r["hook_norms"], reference.norms)) <= 1e-5
        for rank in ranks:
            assert all(rank["dtensor"]) and rank["classes"][0].startswith("FSDP"), what
            assert rank["local"] * 2 == rank["whole"], what  # every dimension 0 here is even
            assert rank["optimizer_local"] == 2 * rank["local"], what  # Adam: two moments per shard
            blocks = sum(name.startswith("FSDP") for name in rank["classes"])
            assert rank["reduce_scatters"] == STEPS * blocks, what  # once a step, not per micro-batch
            assert rank["after"][0] == "Sequential" and not any("FSDP" in name for name in rank["after"])
        # zb_h1 splits the last stage's backwards (its input needs a gradient) of unrecomputed micro-batches:
        # each one (never), the last one (except_last); others none
        unrecomputed = {"never": mesh["chunks"], "except_last": 1}.get(e.get("checkpoint", ""), 0)
        split = STEPS * unrecomputed if schedule == "zb_h1" else 0
        assert [rank["weight_passes"] for rank in ranks] == [split, 0, split, 0], what
        assert not any(type(t).__name__ == "DTensor" for t in ranks[0]["state"].values()), what
    _check_odd_steps(runs[-3], runs[-2], order)
    _check_bf16(runs[-1], order)
    tied = references[True].state_dict()
    assert tied["layers.0.tokens.weight"].data_ptr() == tied["layers.6.weight"].data_ptr()  # tied reference
    assert not torch.equal(tied["layers.0.tokens.weight"], references[False].state_dict()["layers.6.weight"])


def _check_odd_steps(nan: list[dict], none: list[dict], order: list[int]) -> None:
    """Under K=2 × D=2 FSDP a step whose loss is NaN (1f1b, step 1) goes as on one device on every rank: the
    norm NaN from it on, every weight NaN after fit; a ``training_step`` returning ``None`` (step 1) stops
    every rank with Lightning's refusal (it refuses ``None`` on more than one process) after the same step,
    and the next fit in those processes trains as one device (``_check_bf16``)."""
    reference = one_device(order, batch=8, nan_at=1)
    assert all(math.isnan(n) for n in reference.norms[1:]) and not math.isnan(reference.norms[0])
    assert all(v.isnan().all() for v in reference.state_dict().values())
    for record in nan:
        assert record["caught"] is None and record["global_step"] == STEPS
        assert abs(record["norms"][0] - reference.norms[0]) <= 1e-5
        assert all(math.isnan(n) for n in record["norms"][1:]) and len(record["norms"]) == STEPS
    assert all(v.isnan().all() for v in nan[0]["state"].values())
    losses = step_losses([nan[0]["losses"], nan[2]["losses"]], 2)
    # recorded before the NaN: step 1's loss is finite, the later steps' NaN (the weights are)
    assert max(abs(a - b) for a, b in zip(losses[:2], reference.losses[:2])) <= 1e-5
    assert all(math.isnan(x) for x in losses[2:] + reference.losses[2:]) and len(losses) == STEPS
    for record in none:
        assert record["caught"].startswith("RuntimeError: Skipping the `training_step` by returning None")
        assert record["global_step"] == 1


def _check_bf16(ranks: list[dict], order: list[int]) -> None:
    """``bf16-mixed`` (CPU autocast) under K=2 × D=2 FSDP: the losses within 5e-3 of one device's
    ``bf16-mixed`` run (bf16 rounds the replicas' and the whole batch's sums apart), the weights fp32 and
    within 5e-2."""
    reference = one_device(order, batch=8, precision="bf16-mixed")
    losses = step_losses([ranks[0]["losses"], ranks[2]["losses"]])
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 5e-3
    assert max_diff(ranks[0]["state"], reference.state_dict()) <= 5e-2
    assert all(v.dtype == torch.float32 for v in ranks[0]["state"].values())


class LoadOptimizerState(pl.Callback):
    """Give the optimizer the state a sharded checkpoint holds (``load_sharded``'s ``optimizer_states``)."""

    def __init__(self, states: list) -> None:
        self.states = states

    def on_fit_start(self, trainer, pl_module):
        set_sharded_optimizer_states(pl_module, trainer.optimizers, self.states)


def full_batch_one_device(
    steps: int, model: LazyNet | None = None, callbacks=(), tied: bool = False
) -> LazyNet:
    """One device on the whole 8-sample set each step (one epoch a step), Adam, clipped at ``CLIP``
    (``tied``: the LM head tied to the token embedding)."""
    if model is None:
        pl.seed_everything(0, verbose=False)
        model = LazyNet("transformer", lr=LR, deferred=False, size={**SIZE, "tied": tied})
    kwargs = {**trainer_kwargs(steps), "max_epochs": steps, "callbacks": list(callbacks)}
    pl.Trainer(devices=1, gradient_clip_val=CLIP, **kwargs).fit(
        model, make_lazy_data("transformer", 8, 1, SIZE)
    )
    return model


# about 40 s: three launches (4, 2 and 2 processes)
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sharded_checkpoint_saved_under_fsdp_resumes_in_other_layouts_and_loads_into_one_device(tmp_path):
    """checkpoint_format="sharded" under K=2 × D=2 FSDP writes DTensor shards through DCP; K=2 × D=1,
    K=1 × D=2 (FSDP alone) and the unpartitioned module (one process, no process group) each continue from
    it as the uninterrupted one-device run does (≤ 1e-5, losses and weights); so do the two FSDP layouts
    from a full checkpoint (one file) saved under K=2 × D=2 FSDP. A model whose LM head is tied to its token
    embedding across the two stages saves sharded under K=2 × D=2 FSDP and resumes under K=2 × D=1 and under
    K=1 × D=2 (the embedding and the head in one stage, sharded as one FSDP2 group) as the tied one-device
    run continues. Every step trains on the whole 8-sample set, so that every layout sees
    the same samples."""
    fsdp = {"chunks": 2, "data_parallel": "fsdp", "checkpoint_format": "sharded"}
    path, full, tied = tmp_path / "sharded", tmp_path / "full.ckpt", tmp_path / "tied"
    common, as_full = {"full_batch": True}, {"checkpoint_format": "full"}
    saves = [
        {**fsdp, "save": str(path)},
        {**fsdp, **as_full, "save": str(full)},
        {**fsdp, "save": str(tied), "tied": True},
    ]
    saved = fsdp_job(
        tmp_path / "save", 4, [{**s, "pipeline_parallel_size": 2} for s in saves], 4, 2, **common
    )
    chunks = SafeReader(path).read_metadata().state_dict_metadata["model.layers.0.tokens.weight"].chunks
    assert [tuple(c.sizes) for c in chunks] == [(16, 32), (16, 32)]  # the two replicas' DTensor shards
    references = [full_batch_one_device(4), full_batch_one_device(4, tied=True)]
    for ranks, reference in zip(saved, [references[0], references[0], references[1]]):
        first = step_losses([ranks[0]["losses"], ranks[2]["losses"]])
        assert max(abs(a - b) for a, b in zip(first, reference.losses[:2])) <= 1e-5
    for k, d in [(2, 1), (1, 2)]:
        layout = {"pipeline_parallel_size": k, "data_parallel_size": d}
        resumes = [
            {**fsdp, **layout, "resume": str(path)},
            {**fsdp, **layout, **as_full, "resume": str(full)},
        ]
        resumes.append({**fsdp, **layout, "resume": str(tied), "tied": True})  # K=1: tied in one group
        runs = fsdp_job(tmp_path / f"k{k}", 2, resumes, 8 // d, 4, **common)
        for ranks, reference in zip(runs, [references[0], references[0], references[1]]):
            last = [rank["losses"] for rank in ranks if rank["losses"]]
            assert max(abs(a - b) for a, b in zip(step_losses(last), reference.losses[2:])) <= 1e-5, layout
            assert ranks[0]["global_step"] == 4
            assert max_diff(ranks[0]["state"], reference.state_dict()) <= 1e-5, layout
        if k == 1:  # 7 blocks, the embedding and the head one group: 6 reduce-scatters a step, 2 steps
            assert len(runs[2][0]["classes"]) == 7 and runs[2][0]["reduce_scatters"] == 2 * 6
    reference = references[0]
    pl.seed_everything(1, verbose=False)
    plain = LazyNet("transformer", lr=LR, deferred=False, size=SIZE)
    loaded = load_sharded(path, plain, [])
    plain.load_state_dict(loaded["state_dict"])
    assert max_diff(plain.state_dict(), full_batch_one_device(2).state_dict()) <= 1e-5
    optimizer_states = load_sharded(path, plain, [torch.optim.Adam(plain.parameters())])["optimizer_states"]
    full_batch_one_device(2, plain, [LoadOptimizerState(optimizer_states)])
    assert max(abs(a - b) for a, b in zip(plain.losses, reference.losses[2:])) <= 1e-5
    assert max_diff(plain.state_dict(), reference.state_dict()) <= 1e-5


# about 60 s: four processes build and train one step of a 51 M-parameter model
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_fsdp_holds_a_quarter_of_the_parameters_and_adam_state_per_rank_at_k2_d2(tmp_path):
    """K=2 × D=2 FSDP, stage-only construction, ``balance="parameters"``: after a training step each rank
    holds at most 0.3 (ideal 0.25) of what one process training the whole model holds in parameters and
    Adam state (parameters, two moments: 3 × 4 bytes a parameter), counted tensor by tensor."""
    size = {"vocab_size": 256, "num_layers": 16, "d_model": 512, "num_heads": 8, "d_ff": 2048, "seq_len": 16}
    run = {"chunks": 1, "pipeline_parallel_size": 2, "data_parallel_size": 2, "data_parallel": "fsdp"}
    spec = {"size": size, "stage_only": True}
    ranks = fsdp_job(tmp_path, 4, [{**run, "balance": "parameters"}], batch=1, steps=1, **spec)[0]
    whole = sum(rank["whole"] for rank in ranks) // 2  # each stage's parameters, counted by its 2 replicas
    assert whole >= 50_000_000
    one_process = 3 * whole * 4  # bytes: parameters and Adam's two moments, fp32
    per_rank = [(rank["local"] + rank["optimizer_local"]) * 4 for rank in ranks]
    ratio = max(per_rank) / one_process
    print(
        f"parameters {whole:,}; one process {one_process / 2**20:.0f} MiB; per rank "
        f"{[round(b / 2**20) for b in per_rank]} MiB; largest / one process {ratio:.3f}"
    )
    assert ratio <= 0.3


# about 10 s: one launch of six fits
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_equals_replicate_with_accumulation_mixed_precision_validation_and_predict(gpipe_job):
    """tests.models.Net under K=2 × D=2, sharded and replicated, with ``accumulate_grad_batches=2``, again
    under ``bf16-mixed``, and with ``accumulate_grad_batches=2`` under ``schedule="zb_h1"`` (split
    backwards, the gradients reduce-scattered after each batch's last weight pass), each with clipping,
    validation, ``trainer.predict`` and a gradient hook that reads ``self.named_parameters()`` (the whole
    model's, gathered): the same losses, validation loss, gradient norms, predictions and trained weights."""
    runs = []
    zb_h1 = {"schedule": "zb_h1", "checkpoint": "never"}
    accumulate, bf16 = {"accumulate_grad_batches": 2}, {"precision": "bf16-mixed"}
    for extra, schedule in ((accumulate, {}), (bf16, {}), (accumulate, zb_h1)):
        for mode in ("fsdp", "replicate"):
            run = {"chunks": 2, "pipeline_parallel_size": 2, "data_parallel": mode, "trainer": extra}
            runs.append({**run, **schedule})
    results, _ = gpipe_job(
        "mlp",
        4,
        runs,
        steps=3,
        val=True,
        predict=True,
        trainer={"gradient_clip_val": 0.05},
        record_grads=True,
    )
    for sharded, replicated in (results[0:2], results[2:4], results[4:6]):
        assert (
            len(sharded["norms"]) >= 1
            and sharded["predictions"]
            and "val_loss" in sharded["callback_metrics"]
        )
        assert sharded["losses"] == replicated["losses"] and sharded["norms"] == replicated["norms"]
        assert sharded["callback_metrics"] == replicated["callback_metrics"]
        assert all(torch.equal(a, b) for a, b in zip(sharded["predictions"], replicated["predictions"]))
        assert max_diff(sharded["state"], replicated["state"]) <= 1e-6
