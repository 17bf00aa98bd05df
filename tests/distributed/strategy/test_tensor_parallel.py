"""Pipeline × tensor parallel (issue 42, item 3): a Llama-style model parallelized by its own plan on each
stage (``parallelize_stage``), trained with Adam and global-norm clipping, equals the same module trained on
one device: losses, total gradient norms and weights after 4 steps, fp32, within 1e-5."""

import json
import math

import pytest
import pytorch_lightning as pl
import torch
from torch.distributed.checkpoint import format_utils
from torch.utils.data import DistributedSampler

from lightning_gpipe.state.materialize import initialize
from lightning_gpipe.state.sharded import load_sharded, set_sharded_optimizer_states
from tests._harness import check, run_ranks
from tests.conftest import max_diff
from tests.gpt import TP_VOCAB, TensorParallelGPT, gpt_data
from tests.llama import Llama, OddStepLlama, llama_data
from tests.models import trainer_kwargs

CLIP, STEPS = 0.05, 4


def _job(tmp_path, devices: int, runs: list[dict], steps: int = STEPS, timeout: float = 280, **extra):
    """tests/workers/tensor_parallel.py over ``devices`` ranks; per run, every rank's record."""
    spec = {"devices": devices, "out": str(tmp_path), "steps": steps, "clip": CLIP, "runs": runs, **extra}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    for result in run_ranks("tests/workers/tensor_parallel.py", devices, str(path), timeout=timeout):
        check(result)
    return [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(devices)]
        for k in range(len(runs))
    ]


def _one_device(batch=8, order=None, samples=None, steps=STEPS, with_optimizer=False):
    """The module trained on one device for ``steps`` steps of ``batch`` (``samples`` in ``order``)."""
    pl.seed_everything(0, verbose=False)
    model = Llama()
    trainer = pl.Trainer(devices=1, gradient_clip_val=CLIP, **trainer_kwargs(steps))
    trainer.fit(model, llama_data(batch, steps, order, samples))
    return (model, trainer.optimizers[0].state_dict()) if with_optimizer else model


def _step_losses(losses: list[float]) -> list[float]:
    """Per step: under 1f1b ``training_step`` runs per micro-batch (2 of 4 samples, as many tokens): their
    mean."""
    if len(losses) == 2 * STEPS:
        return [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
    return losses


def _check_placement(ranks: list[dict], stages: int, replicas: int, tensors: int) -> None:
    """Rank ``(d·K + (K-1-s))·T + t`` holds stage ``s``'s tensor-parallel shard ``t`` of replica ``d``,
    its stage's parameters DTensors."""
    for rank, record in enumerate(ranks):
        d, s, t = rank // (stages * tensors), record["stage"], rank % tensors
        assert rank == (d * stages + (stages - 1 - s)) * tensors + t
        assert list(record["coordinate"]) == [stages - 1 - s, d, t]
        assert record["dtensor_parameters"] > 0


@pytest.mark.timeout(400)
def test_pipeline_by_tensor_parallel_matches_one_device(tmp_path):
    """K = 2 × T = 2 (4 processes): under gpipe the cut falls between ``Up`` and ``Down``, so a ``Shard(-1)``
    DTensor travels between the stages; under 1f1b it falls after the first block (a plain tensor). Each
    trainer then validates from its checkpoint (full, then sharded), the plan applied again, as one device
    does. In the same processes (issue 42, item 4): the model built on the meta device (each rank
    materializes its stage, then the plan shards it); the GPT with its embedding and head tied across the
    stages, the plan leaving them plain (``balance="time"``), parallelizing both (``"parameters"``, 1f1b) or
    the embedding alone (zb_h1);
    the sharded checkpoint of the 1f1b run resumed under K = 1 × T = 4 and K = 2 × D = 2 × T = 1 (and, in
    this process, into the unpartitioned module); bf16-mixed; a NaN loss at step 1 (NaN on every rank, as
    on one device); a ``training_step`` returning ``None`` (refused on every rank after the same step), then
    ``balance="memory"`` (1f1b) in the same processes. Every rank's
    ``grad_norm(self)`` in ``on_before_optimizer_step`` is the whole model's (issue 40)."""
    mesh = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "chunks": 2}
    resume = {
        "resume_from": 1,
        "trainer": {"max_steps": -1, "max_epochs": 2, "use_distributed_sampler": False},
    }
    runs = [
        {**mesh, "balance": [4, 4], "validate": True},
        {**mesh, "balance": [2, 6], "schedule": "1f1b", "checkpoint_format": "sharded", "validate": True,
         "trainer": {"max_steps": 2 * STEPS}},  # ends with epoch 0 (4 steps): resumed at epoch 1
        {**mesh, "balance": [4, 4], "build": "meta"},
        {**mesh, "model": "gpt", "balance": "time"},
        {**mesh, "model": "gpt_tied_plan", "balance": "parameters", "schedule": "1f1b"},
        {**mesh, "model": "gpt_embed_plan", "balance": [3, 4], "schedule": "zb_h1"},
        {"pipeline_parallel_size": 1, "tensor_parallel_size": 4, **resume},
        {"pipeline_parallel_size": 2, "data_parallel_size": 2, "chunks": 2, **resume},  # the same batches
        {**mesh, "balance": [4, 4], "precision": "bf16-mixed"},
        {**mesh, "balance": [4, 4], "model": "llama_nan"},
        {**mesh, "balance": [4, 4], "model": "llama_none"},  # refused: the next fit in the same processes
        {**mesh, "balance": "memory", "schedule": "1f1b"},  # profiled on rank 0 before the plan
    ]  # fmt: skip
    results = _job(tmp_path, 4, runs)
    reference, optimizer = _one_device(with_optimizer=True)
    assert min(reference.norms) > CLIP  # clipping acts on every step
    expected = reference.state_dict()
    after_fit = reference(next(iter(llama_data()))[0]).detach()
    pl.Trainer(devices=1, **trainer_kwargs(STEPS)).validate(reference, llama_data(steps=1), verbose=False)
    _check_odd_steps(results[9], results[10])
    for ranks in results[11:]:  # balance="memory": whichever balance it chose, one device's training
        assert (
            all(record["balance"] == ranks[0]["balance"] for record in ranks)
            and sum(ranks[0]["balance"]) == 8
        )
        for rank in (0, 1):
            losses = _step_losses(ranks[rank]["losses"])
            assert len(losses) == STEPS
            assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5
        for record in ranks:
            for key in ("norms", "hook_norms"):
                assert max(abs(a - b) / b for a, b in zip(record[key], reference.norms)) <= 1e-5
            assert max_diff(record["state"], expected) <= 1e-5
    for ranks in results[:2]:
        # validate after fit, the same trainer, from the full (run 0) and sharded (run 1) checkpoints saved at
        # the end of training: the plan is applied again (torch refuses a marked module) and the weights
        # alone are read (fit's optimizers hold the parameters the plan has since replaced)
        for rank in (0, 1):
            assert abs(ranks[rank]["val_losses"][0] - reference.val_losses[0]) <= 1e-5
        _check_placement(ranks, stages=2, replicas=1, tensors=2)
        for rank in (0, 1):  # both tensor-parallel ranks of the last stage compute the loss
            losses = _step_losses(ranks[rank]["losses"])
            assert len(losses) == STEPS
            assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5
        for record in ranks:  # every rank: the same total norm, the whole trained model after fit
            assert max(abs(a - b) / b for a, b in zip(record["norms"], reference.norms)) <= 1e-5
            assert max(abs(a - b) / b for a, b in zip(record["hook_norms"], reference.norms)) <= 1e-5
            assert max_diff(record["state"], expected) <= 1e-5
            assert (record["after_fit"] - after_fit).abs().max() <= 1e-5  # the plan is off after fit
    # saved at the end of training, the stages parallelized: whole tensors, model and Adam state
    full = torch.load(tmp_path / "run0.ckpt", weights_only=False)
    assert max_diff(full["state_dict"], expected) <= 1e-5
    (saved,) = full["optimizer_states"]
    for i, state in optimizer["state"].items():
        for field in ("exp_avg", "exp_avg_sq"):
            assert (saved["state"][i][field] - state[field]).abs().max() <= 1e-5
    format_utils.dcp_to_torch_save(tmp_path / "run1.ckpt", tmp_path / "sharded.pt")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)["model"]
    assert max_diff(sharded, expected) <= 1e-5
    _check_stage_only(results[2])
    _check_tied(results[3], results[4], results[5])
    _check_resumed(results[6], results[7], tmp_path / "run1.ckpt")
    _check_bf16(results[8], reference)


def _check_odd_steps(nan: list[dict], none: list[dict]) -> None:
    """A NaN loss at step 1 goes as on one device on every rank (the norm NaN from it on, every weight NaN
    after fit); a ``training_step`` returning ``None`` at step 1 is refused on every rank after the same
    step (Lightning refuses ``None`` on more than one process)."""
    pl.seed_everything(0, verbose=False)
    model = OddStepLlama(nan_at=1)
    pl.Trainer(devices=1, gradient_clip_val=CLIP, **trainer_kwargs(STEPS)).fit(model, llama_data())
    assert all(math.isnan(n) for n in model.norms[1:]) and not math.isnan(model.norms[0])
    assert all(v.isnan().all() for v in model.state_dict().values())
    for record in nan:
        assert len(record["norms"]) == STEPS and abs(record["norms"][0] - model.norms[0]) <= 1e-5
        assert all(math.isnan(n) for n in record["norms"][1:])
        assert all(v.isnan().all() for v in record["state"].values())
    for rank in (0, 1):  # recorded before the NaN: step 1's loss finite, the later steps' NaN
        losses = nan[rank]["losses"]
        assert max(abs(a - b) for a, b in zip(losses[:2], model.losses[:2])) <= 1e-5
        assert all(math.isnan(x) for x in losses[2:]) and len(losses) == STEPS
    for record in none:
        assert record["caught"].startswith("RuntimeError: Skipping the `training_step` by returning None")
        assert record["global_step"] == 1


def _check_stage_only(ranks: list[dict]) -> None:
    """Built on the meta device, each rank holds only its stage's layers (the others stay meta), trained
    as one device trains the module initialized as the stages would (:func:`initialize`)."""
    pl.seed_everything(0, verbose=False)
    model = Llama()
    initialize(model.layers, seed=0)
    pl.Trainer(devices=1, gradient_clip_val=CLIP, **trainer_kwargs(STEPS)).fit(model, llama_data())
    layers = {
        0: {"layers.0.", "layers.1.", "layers.2.", "layers.3."},
        1: {"layers.5.", "layers.6.", "layers.7."},
    }
    for record in ranks:
        real = {k: v for k, v in record["state"].items() if not v.is_meta}
        assert {k[: len("layers.0.")] for k in real} == layers[record["stage"]]
        assert record["dtensor_parameters"] > 0
        assert max_diff(real, {k: v for k, v in model.state_dict().items() if k in real}) <= 1e-5
        assert max(abs(a - b) / b for a, b in zip(record["hook_norms"], model.norms)) <= 1e-5
    for rank in (0, 1):
        assert max(abs(a - b) for a, b in zip(ranks[rank]["losses"], model.losses)) <= 1e-5


def _check_tied(plain: list[dict], parallel: list[dict], embed_only: list[dict]) -> None:
    """The GPT's head tied to its embedding across the two stages trains as on one device, the plan
    leaving both plain, sharding both (the head colwise, the embedding rowwise: the weight's vocabulary
    dimension) or the embedding alone (zb_h1: the copies placed differently); the tied weight counts once
    in the clipped norm and in ``grad_norm(self)``; every rank holds the logged epoch loss."""
    pl.seed_everything(0, verbose=False)
    model = TensorParallelGPT()
    pl.Trainer(devices=1, gradient_clip_val=CLIP, **trainer_kwargs(STEPS)).fit(
        model, gpt_data(vocab=TP_VOCAB)
    )
    assert min(model.norms) > CLIP
    for ranks in (plain, parallel, embed_only):
        for rank in (0, 1):
            losses = _step_losses(ranks[rank]["losses"])
            assert max(abs(a - b) for a, b in zip(losses, model.losses)) <= 1e-5
        for record in ranks:
            tied = {0: "embed.tok.weight", 1: "head.weight"}[record["stage"]]  # this stage's name of it
            sharded = ranks is parallel or (ranks is embed_only and record["stage"] == 0)
            assert (tied in record["dtensor_names"]) == sharded
            assert any(".mlp.0.weight" in name for name in record["dtensor_names"])
            assert max(abs(a - b) / b for a, b in zip(record["norms"], model.norms)) <= 1e-5
            assert max(abs(a - b) / b for a, b in zip(record["hook_norms"], model.norms)) <= 1e-5
            assert max_diff(record["state"], model.state_dict()) <= 1e-5
            assert torch.equal(record["state"]["embed.tok.weight"], record["state"]["head.weight"])
            logged = record["metrics"]["train_loss"]  # the epoch's mean, shared with every stage and rank
            assert abs(logged - sum(model.losses) / STEPS) <= 1e-5


class _LoadOptimizerState(pl.Callback):
    """Give the optimizer the state a sharded checkpoint holds (``load_sharded``'s ``optimizer_states``)."""

    def __init__(self, states: list) -> None:
        self.states = states

    def on_fit_start(self, trainer, pl_module):
        set_sharded_optimizer_states(pl_module, trainer.optimizers, self.states)


def _check_resumed(k1_t4: list[dict], k2_d2: list[dict], path) -> None:
    """The sharded checkpoint written under K = 2 × T = 2 (DTensor shards through DCP) at the end of epoch 0,
    resumed under K = 1 × T = 4 and K = 2 × D = 2 × T = 1 (both replicas on the same batches) and loaded into
    the unpartitioned module (one process), trains epoch 1 as one device trains both epochs."""
    both = _one_device(order=list(range(8 * STEPS)) * 2, samples=8 * STEPS, steps=2 * STEPS)
    for ranks in (k1_t4, k2_d2):
        losses = [record["losses"] for record in ranks if record["losses"]]
        assert losses and all(len(step) == STEPS for step in losses)
        assert max(abs(a - b) for step in losses for a, b in zip(step, both.losses[STEPS:])) <= 1e-5
        for record in ranks:  # K = 1: grad_norm(self) over the stage's DTensors whole
            for key in ("norms", "hook_norms"):
                assert max(abs(a - b) / b for a, b in zip(record[key], both.norms[STEPS:])) <= 1e-5
            assert max_diff(record["state"], both.state_dict()) <= 1e-5
    plain = Llama()
    plain.load_state_dict(load_sharded(path, plain, [])["state_dict"])
    states = load_sharded(path, plain, [torch.optim.Adam(plain.parameters())])["optimizer_states"]
    trainer = pl.Trainer(
        devices=1, gradient_clip_val=CLIP, callbacks=[_LoadOptimizerState(states)], **trainer_kwargs(STEPS)
    )
    trainer.fit(plain, llama_data())
    assert max(abs(a - b) for a, b in zip(plain.losses, both.losses[STEPS:])) <= 1e-5
    assert max_diff(plain.state_dict(), both.state_dict()) <= 1e-5


def _check_bf16(ranks: list[dict], fp32) -> None:
    """bf16-mixed (CPU autocast) runs under K = 2 × T = 2: its losses are one device's bf16-mixed losses,
    loosely (bf16 rounds the parallel matmuls' partial sums apart), and nearer them than to fp32's."""
    pl.seed_everything(0, verbose=False)
    model = Llama()
    trainer = pl.Trainer(devices=1, gradient_clip_val=CLIP, precision="bf16-mixed", **trainer_kwargs(STEPS))
    trainer.fit(model, llama_data())
    for rank in (0, 1):
        losses = ranks[rank]["losses"]
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, model.losses)) <= 5e-3
    for record in ranks:
        assert max_diff(record["state"], model.state_dict()) <= 5e-2
        assert all(v.dtype == torch.float32 for v in record["state"].values())  # the weights stay fp32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_other_schedules_and_sharded_logits_by_tensor_parallel_match_one_device(tmp_path):
    """K = 2 × T = 2 under interleaved_1f1b (4 parts, 2 per stage: the ``Up`` → ``SiLU`` cut sends a DTensor
    from the last stage back to the first) and zb_h1 (input and weight gradients apart); and with the last
    stage's output a DTensor (sharded logits, the loss under ``loss_parallel``), under gpipe and 1f1b."""
    mesh = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "chunks": 2}
    runs = [
        {**mesh, "schedule": "interleaved_1f1b", "balance": [2, 2, 2, 2]},
        {**mesh, "schedule": "zb_h1", "balance": [4, 4]},
        {**mesh, "balance": [4, 4], "model": "sharded_logits"},
        {**mesh, "balance": [4, 4], "model": "sharded_logits", "schedule": "1f1b"},
    ]
    results = _job(tmp_path, 4, runs)
    reference = _one_device()
    for run, ranks in zip(runs, results):
        _check_placement(ranks, stages=2, replicas=1, tensors=2)
        assert (ranks[0]["dtensor_outputs"] > 0) == ("model" in run)  # the sharded logits reach the step
        losses = _step_losses(ranks[0]["losses"])
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5
        for record in ranks:
            assert max(abs(a - b) / b for a, b in zip(record["norms"], reference.norms)) <= 1e-5
            assert max_diff(record["state"], reference.state_dict()) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_by_data_by_tensor_parallel_matches_one_device(tmp_path):
    """K = 2 × D = 2 × T = 2 (8 processes, replicated data parallel): each replica trains on its
    DistributedSampler shard; one device trains on both shards' batches together. Resumed from the full
    checkpoint saved at the end of epoch 0 (whole model and Adam state, loaded into the DTensor shards), a new
    module trains epoch 1 as one device trains both epochs."""
    runs = [{"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 2, "chunks": 2}]
    resume = {"max_steps": -1, "max_epochs": 2}  # from the checkpoint at the end of epoch 0: epoch 1
    (ranks,) = _job(tmp_path, 8, runs, steps=2 * STEPS, timeout=380, resume=resume)
    _check_placement(ranks, stages=2, replicas=2, tensors=2)
    order = _two_replica_order(2)
    reference = _one_device(batch=16, order=order[: 16 * STEPS], samples=8 * 2 * STEPS)
    resumed = _one_device(batch=16, order=order, samples=8 * 2 * STEPS, steps=2 * STEPS)  # both epochs
    for prefix, expected in (("", reference), ("resumed_", resumed)):
        replicas = zip(ranks[0][f"{prefix}losses"], ranks[4][f"{prefix}losses"])  # replica 0, replica 1
        losses = [(a + b) / 2 for a, b in replicas]
        tail = expected.losses[-len(losses) :]  # resumed: epoch 1's steps
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, tail)) <= 1e-5
        for record in ranks:
            norms = record[f"{prefix}norms"]
            assert max(abs(a - b) / b for a, b in zip(norms, expected.norms[-len(norms) :])) <= 1e-5
            assert max_diff(record[f"{prefix}state"], expected.state_dict()) <= 1e-5


def _two_replica_order(epochs: int) -> list[int]:
    """The samples one device takes to equal D = 2 replicas under DDP's sampler: every step, replica 0's batch
    of 8, then replica 1's, for ``epochs`` epochs of ``STEPS`` steps over ``8 × 2 × STEPS`` samples."""
    order = []
    for epoch in range(epochs):
        shards = []
        for d in (0, 1):
            sampler = DistributedSampler(range(8 * 2 * STEPS), num_replicas=2, rank=d, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        order += [i for s in range(STEPS) for d in (0, 1) for i in shards[d][s * 8 : (s + 1) * 8]]
    return order


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_pipeline_by_fsdp_by_tensor_parallel_matches_one_device(tmp_path):
    """K = 2 × D = 2 × T = 2 with ``data_parallel="fsdp"`` (8 processes): the plan's DTensors sharded again
    over the data-parallel dimension (2-D DTensors), under gpipe (a ``Shard(-1)`` DTensor crossing the cut),
    1f1b, interleaved_1f1b and zb_h1 (split backwards, reduce-scattered after the last weight pass);
    losses, clipped norms and weights equal one device's on both replicas' batches. Resumed from the
    checkpoint saved at the end of epoch 0 (full, whole tensors loaded into the 2-D shards; under 1f1b
    sharded, through DCP), a new module trains epoch 1 as one device trains both epochs."""
    mesh = {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 2, "chunks": 2}
    runs = [
        {**mesh, "data_parallel": "fsdp", "balance": [4, 4]},
        {
            **mesh,
            "data_parallel": "fsdp",
            "balance": [2, 6],
            "schedule": "1f1b",
            "checkpoint_format": "sharded",
        },
        {**mesh, "data_parallel": "fsdp", "balance": [2, 2, 2, 2], "schedule": "interleaved_1f1b"},
        {**mesh, "data_parallel": "fsdp", "balance": [4, 4], "schedule": "zb_h1", "checkpoint": "never"},
    ]
    resume = {"max_steps": -1, "max_epochs": 2}
    results = _job(tmp_path, 8, runs, steps=2 * STEPS, timeout=480, resume=resume)
    order = _two_replica_order(2)
    reference = _one_device(batch=16, order=order[: 16 * STEPS], samples=8 * 2 * STEPS)
    resumed = _one_device(batch=16, order=order, samples=8 * 2 * STEPS, steps=2 * STEPS)  # both epochs
    assert min(reference.norms) > CLIP  # clipping acts on every step
    for ranks in results:
        _check_placement(ranks, stages=2, replicas=2, tensors=2)
        assert all(record["dtensor_mesh_dims"] == 2 for record in ranks)  # FSDP × TP: 2-D DTensors
        for prefix, expected in (("", reference), ("resumed_", resumed)):
            replicas = zip(
                _step_losses(ranks[0][f"{prefix}losses"]), _step_losses(ranks[4][f"{prefix}losses"])
            )
            losses = [(a + b) / 2 for a, b in replicas]
            assert len(losses) == STEPS
            assert max(abs(a - b) for a, b in zip(losses, expected.losses[-STEPS:])) <= 1e-5
            for record in ranks:
                norms = record[f"{prefix}norms"]
                assert max(abs(a - b) / b for a, b in zip(norms, expected.norms[-len(norms) :])) <= 1e-5
                assert max_diff(record[f"{prefix}state"], expected.state_dict()) <= 1e-5
