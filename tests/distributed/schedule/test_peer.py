"""Our gradients equal those of PyTorch's own torch.distributed.pipelining ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble."""

import pytest
import torch

from tests._harness import check, run_ranks
from tests.conftest import max_diff


def _peer_grads(tmp_path, prefix):
    peer = {}
    for r in range(2):
        peer.update(torch.load(tmp_path / f"{prefix}rank{r}.pt"))
    return peer


@pytest.mark.timeout(300)
def test_gradients_match_torch_pipelining_schedule_gpipe_1f1b_interleaved_and_zb_h1(gpipe_job, tmp_path):
    """Same 2-stage split, batch 8 in 4 micro-batches, one step: schedule="gpipe" against ScheduleGPipe,
    schedule="1f1b" against Schedule1F1B, schedule="interleaved_1f1b" with virtual_stages=2 against
    ScheduleInterleaved1F1B on the same 4 parts (each rank holds the peer's stages p and p+2 of 4),
    schedule="zb_h1" against ScheduleInterleavedZeroBubble with one stage per rank.

    The peer sums per-micro-batch losses, so its loss function scales each micro-batch's summed
    error by 1/(N·outputs), which makes the sum the full batch's mean, our user's loss (under
    "gpipe" computed on the whole batch; under "1f1b" each micro-batch's mean weighted by n_i/N).
    """
    runs = [
        {"chunks": 4, "checkpoint": "always"},
        {"chunks": 4, "checkpoint": "except_last", "schedule": "1f1b"},
        {"chunks": 4, "checkpoint": "never", "schedule": "interleaved_1f1b", "virtual_stages": 2},
        {"chunks": 4, "checkpoint": "never", "schedule": "zb_h1"},
    ]
    _, grads = gpipe_job("mlp", 2, runs, steps=1, batch=8, record_grads=True)
    for rc_out in run_ranks(
        "tests/workers/peer_pipelining.py",
        2,
        str(tmp_path),
        "4",
        "8",
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zb_h1",
        timeout=180,
    ):
        check(rc_out)
    for run_grads, prefix in zip(grads, ("peer_", "peer_1f1b_", "peer_interleaved_1f1b_", "peer_zb_h1_")):
        peer = _peer_grads(tmp_path, prefix)
        ours = {}
        for rank_grads in run_grads:
            ours.update(rank_grads[0])
        assert set(ours) == set(peer) == {f"layers.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
        assert max_diff(ours, peer) <= 1e-6, prefix
