"""Every rank starts from global rank 0: its weights and its random state (CPU, Gloo, hard timeouts)."""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import Net, build_layers, make_data, pl, train_single_device, trainer_kwargs


@pytest.mark.timeout(300)
def test_rank0_weights_and_shuffled_batches_as_on_one_device(gpipe_job):
    """2 stages; "pretrained" weights loaded only where LOCAL_RANK == 0 (BatchNorm buffers too); a seeded,
    shuffling loader over 2 epochs. Training starts from rank 0's state on every stage, sees the one-device
    batches in the one-device order and ends equal to one device (chunks=1: BatchNorm sees the full batch)."""
    with torch.random.fork_rng():
        torch.manual_seed(7)
        pretrained = build_layers("bn").state_dict()
    extra = {"max_epochs": 2, "max_steps": -1}
    reference = train_single_device(
        "bn",
        0,
        steps=-1,
        trainer_extra=extra,
        data={"shuffle": True, "samples": 40},
        indexed=True,
        pretrained_seed=7,
    )
    results, _ = gpipe_job(
        "bn",
        2,
        [{"chunks": 1}],
        steps=-1,
        samples=40,
        shuffle=True,
        trainer=extra,
        record_start_state=True,
        net={"indexed": True, "pretrained_seed": 7},
    )
    r = results[0]
    start = {k[len("layers.") :]: v for k, v in r["start_state"].items() if k.startswith("layers.")}
    assert max_diff(start, pretrained) == 0.0
    assert len(reference.indices) == 8
    for rank in r["ranks"]:  # every stage drew the one-device permutation in both epochs
        assert rank["indices"] == reference.indices
    assert max(abs(a - b) for a, b in zip(r["losses"], reference.losses)) <= 1e-5
    assert max_diff(r["state"], reference.state_dict()) <= 1e-5


def _randperms(rng_state: torch.Tensor, n: int, epochs: int) -> list[int]:
    """The sample order a ``DataLoader(shuffle=True)`` without a generator gives over ``epochs`` epochs
    from the global torch generator in ``rng_state``: each epoch its iterator draws a base seed (for
    workers), then RandomSampler a seed for a generator of its own, which draws the permutation."""
    order: list[int] = []
    with torch.random.fork_rng():
        torch.set_rng_state(rng_state)
        for _ in range(epochs):
            torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            order += torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return order


@pytest.mark.timeout(120)
def test_unseeded_script_trains_rank0_start_with_rank0_batches(gpipe_job):
    """An unseeded script (no seed_everything; each process's generators from OS entropy, so each builds
    different weights and holds a different random state); 2 stages, chunks=2, a shuffling loader over 2
    epochs, no dropout. Every stage starts from rank 0's weights as built before the partition, every
    stage draws the permutation rank 0's generator gives, and the pipeline ends equal to one device
    trained from rank 0's start state on those batches in that order."""
    extra = {"max_epochs": 2, "max_steps": -1}
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 2}],
        timeout=90,
        seed=None,
        steps=-1,
        samples=40,
        shuffle=True,
        trainer=extra,
        record_start_state=True,
        net={"indexed": True},
    )
    r = results[0]
    rank0, rank1 = r["ranks"]
    # the processes really did differ before fit (else the test shows nothing)
    assert max_diff(rank0["init_state"], rank1["init_state"]) > 0.1
    assert not torch.equal(rank0["init_rng"], rank1["init_rng"])
    # (a) the state every stage started from (gathered onto rank 0 as training starts) is rank 0's
    assert max_diff(r["start_state"], rank0["init_state"]) == 0.0
    # (b) every stage drew rank 0's permutation in both epochs, batch by batch
    order = _randperms(rank0["init_rng"], 40, 2)
    expected = [order[i : i + 10] for i in range(0, 80, 10)]
    for rank in r["ranks"]:
        assert rank["indices"] == expected
    # (c) one device from rank 0's start state (weights and generator) on the same batches
    model = Net("mlp", lr=0.1, indexed=True)
    model.load_state_dict(rank0["init_state"])
    trainer = pl.Trainer(devices=1, **{**trainer_kwargs(-1), **extra})
    loader = make_data("mlp", 10, 5, indexed=True, samples=40, shuffle=True)
    with torch.random.fork_rng():
        torch.set_rng_state(rank0["init_rng"])
        trainer.fit(model, loader)
    assert model.indices == expected
    assert max(abs(a - b) for a, b in zip(r["losses"], model.losses, strict=True)) <= 1e-5
    assert max_diff(r["state"], model.state_dict()) <= 1e-5
