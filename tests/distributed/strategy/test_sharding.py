"""Sharded data parallel per stage (``data_parallel="fsdp"``, issue 42 item 2) equals one device (CPU, Gloo,
hard timeouts)."""

import json

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._harness import check, run_ranks
from tests.conftest import max_diff
from tests.models import LazyNet, make_lazy_data, trainer_kwargs

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


def one_device(order: list[int], batch: int, steps: int = STEPS, ckpt_path: str | None = None) -> LazyNet:
    """The reference: the same module (seed 0) on one device, Adam, clipped at ``CLIP``, the worker's samples
    in ``order``, ``batch`` a step."""
    pl.seed_everything(0, verbose=False)
    model = LazyNet("transformer", lr=LR, deferred=False, size=SIZE)
    trainer = pl.Trainer(devices=1, gradient_clip_val=CLIP, **trainer_kwargs(steps))
    x, y = make_lazy_data("transformer", batch, len(order) // batch, SIZE).dataset.tensors
    data = DataLoader(TensorDataset(x[order], y[order]), batch_size=batch)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model


def fsdp_job(tmp_path, devices: int, runs: list[dict], batch: int, steps: int = STEPS) -> list[list[dict]]:
    """Run tests/workers/fsdp.py over ``devices`` ranks; per run, every rank's record."""
    spec = {"out": str(tmp_path), "devices": devices, "size": SIZE, "batch": batch, "steps": steps}
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
    """K=2 stages × D=2 FSDP replicas (4 processes): gpipe, 1f1b and interleaved_1f1b, each 4 steps of Adam
    with gradient clipping by the global norm, equal one device on the concatenated batch (≤ 1e-5 on the
    losses and the trained weights). Each rank holds half its stage's parameters and optimizer state, as
    DTensor shards; each block's gradients are reduce-scattered once a step, not once per micro-batch; and
    after fit the Sequential is whole and unwrapped again."""
    mesh = {"chunks": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2, "data_parallel": "fsdp"}
    schedules = ["gpipe", "1f1b", "interleaved_1f1b"]
    runs = fsdp_job(tmp_path, 4, [{**mesh, "schedule": s} for s in schedules], batch=4)
    reference = one_device(replicas_order(2, 4, STEPS), batch=8)
    for schedule, ranks in zip(schedules, runs):
        # ranks 0 and 2 run the last stage of replicas 0 and 1 (the layout's formula)
        losses = step_losses([ranks[0]["losses"], ranks[2]["losses"]], 1 if schedule == "gpipe" else 2)
        assert len(losses) == STEPS, schedule
        assert max(abs(a - b) for a, b in zip(losses, reference.losses)) <= 1e-5, schedule
        assert max_diff(ranks[0]["state"], reference.state_dict()) <= 1e-5, schedule
        for rank in ranks:
            assert all(rank["dtensor"]) and rank["classes"][0].startswith("FSDP"), schedule
            assert rank["local"] * 2 == rank["whole"], schedule  # every dimension 0 here is even
            assert rank["optimizer_local"] == 2 * rank["local"], schedule  # Adam: two moments per shard
            blocks = sum(name.startswith("FSDP") for name in rank["classes"])
            assert rank["reduce_scatters"] == STEPS * blocks, schedule  # once a step, not per micro-batch
            assert rank["after"][0] == "Sequential" and not any("FSDP" in name for name in rank["after"])
        assert not any(type(t).__name__ == "DTensor" for t in ranks[0]["state"].values()), schedule
