"""Every rank starts from global rank 0: its weights and its random state (CPU, Gloo, hard timeouts)."""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import build_layers, train_single_device


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
