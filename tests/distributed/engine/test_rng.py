"""Random layers under the pipeline: each stage draws its masks per micro-batch from its own stream, seeded
from rank 0's generator and the stage's index (README, "Every rank starts from rank 0's random state"; CPU,
Gloo, hard timeouts).

Here the glue only processes show: every rank draws the same numbers in the user's code. That a stage's masks
equal one device's running the stage's layers on the micro-batches from its stream, and that recompute
replays them, is checked in one process (tests/test_transparency_grid.py).
"""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import train_single_device


@pytest.mark.timeout(120)
def test_random_layers_on_one_stage_leave_every_stage_the_same_batches_every_epoch(gpipe_job):
    """Both dropouts on stage 0 of 2 ([5, 1]), a shuffling loader over 3 epochs of 2 steps: the first stage
    draws its masks, the last none, yet every stage draws the same permutation in every epoch (the loader
    draws each epoch's seed from the global generator, which the stages' layers leave alone:
    ``lightning_gpipe.engine.rng``), and the global generators agree at the end. Before, the ranks parted
    from the second epoch: the inputs of one permutation trained against the targets of another."""
    results, _ = gpipe_job(
        "dropout",
        2,
        [{"chunks": 2, "balance": [5, 1]}],
        timeout=90,
        steps=-1,
        samples=20,
        shuffle=True,
        trainer={"max_epochs": 3, "max_steps": -1},
        net={"indexed": True},
    )
    ranks = results[0]["ranks"]
    epochs = [ranks[0]["indices"][2 * e : 2 * e + 2] for e in range(3)]
    assert len({str(e) for e in epochs}) == 3  # shuffled: each epoch its own order
    for rank in ranks[1:]:
        assert rank["indices"] == ranks[0]["indices"]
        assert torch.equal(rank["rng_after"], ranks[0]["rng_after"])


@pytest.mark.timeout(120)
def test_draws_after_the_pipelined_call_reach_every_stage_with_the_step_outcome(gpipe_job):
    """``training_step`` draws from torch's generator after the pipelined call (code only the last stage
    runs); with a shuffling loader over 3 epochs every stage still draws one device's permutation in every
    epoch and ends with one device's generator state: the last stage's generator state travels with the
    step outcome (``lightning_gpipe.engine.outcome``)."""
    extra = {"max_epochs": 3, "max_steps": -1}
    net = {"indexed": True, "draw_after_call": True}
    reference = train_single_device(
        "mlp", 0, steps=-1, trainer_extra=extra, data={"shuffle": True, "samples": 20}, **net
    )
    results, _ = gpipe_job(
        "mlp", 2, [{"chunks": 2}], timeout=90, steps=-1, samples=20, shuffle=True, trainer=extra, net=net
    )
    assert len(reference.indices) == 6
    for rank in results[0]["ranks"]:
        assert rank["indices"] == reference.indices
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference.losses)) <= 1e-5
    assert max_diff(results[0]["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(120)
def test_per_micro_batch_calls_draw_the_same_numbers_before_the_call_on_every_stage(gpipe_job):
    """Under 1F1B ``training_step`` runs once per micro-batch; it draws before the pipelined call (a random
    mask every stage must agree on: the first stage's input, the last stage's loss) and after it (last stage
    only). Every stage draws the same numbers before the call in every call of every step: the last
    stage's code after the call draws from its own stream (``lightning_gpipe.engine.rng``)."""
    net = {"draw_before_call": True, "draw_after_call": True}
    results, _ = gpipe_job("mlp", 2, [{"chunks": 4, "schedule": "1f1b"}], timeout=90, steps=3, net=net)
    ranks = results[0]["ranks"]
    assert len(ranks[0]["pre_draws"]) == 12  # 3 steps of 4 calls
    assert len({str(d) for d in ranks[0]["pre_draws"]}) == 12
    for rank in ranks[1:]:
        assert rank["pre_draws"] == ranks[0]["pre_draws"]
