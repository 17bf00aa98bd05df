"""Skip connections across stages (torchgpipe's stash/pop idea), point-to-point from producer to consumer."""

import pytest

from tests.models import train_single_device


@pytest.mark.timeout(300)
def test_skip_from_stage_0_to_stage_2_bypasses_stage_1(gpipe_job):
    """3 stages; stage 0 stashes, stage 2 pops: gradients equal one device; stage 1 never receives it."""
    reference = train_single_device("unet", 0, steps=2, record_grads=True)
    runs = [{"chunks": 3, "checkpoint": "always"}, {"chunks": 2, "checkpoint": "never"}]
    results, grads = gpipe_job("unet", 3, runs, steps=2, record_grads=True)
    for result, per_rank in zip(results, grads):
        for rank_grads in per_rank:
            for ours, ref in zip(rank_grads, reference.grads):
                assert max((ours[k] - ref[k]).abs().max().item() for k in ours) <= 1e-5
        ranks = result["ranks"]  # rank 0: stage 2, rank 1: stage 1, rank 2: stage 0
        assert ranks[1]["received_skips"] == []
        assert ranks[2]["received_skips"] == []
        assert ranks[0]["received_skips"] and {s for s in ranks[0]["received_skips"]} == {("enc", 0)}


@pytest.mark.timeout(300)
def test_skip_to_the_next_stage_arrives_as_the_skip_not_as_the_activation(gpipe_job):
    """2 stages, [3, 3]: stage 0 sends stage 1 both its output and the skip, same shape (n, 8); not
    swapped."""
    reference = train_single_device("unet", 0, steps=2, record_grads=True)
    results, grads = gpipe_job("unet", 2, [{"chunks": 3, "balance": [3, 3]}], steps=2, record_grads=True)
    for rank_grads in grads[0]:
        for ours, ref in zip(rank_grads, reference.grads):
            assert max((ours[k] - ref[k]).abs().max().item() for k in ours) <= 1e-5
    assert {s for s in results[0]["ranks"][0]["received_skips"]} == {("enc", 0)}
