"""Our gradients equal those of PyTorch's own torch.distributed.pipelining ScheduleGPipe and Schedule1F1B."""

import pytest
import torch

from tests._harness import check, run_ranks
from tests.conftest import max_diff


@pytest.mark.timeout(300)
def test_gradients_match_torch_pipelining_schedule_gpipe(gpipe_job, tmp_path):
    """Same 2-stage split, batch 8 in 4 micro-batches, one step.

    The peer sums per-micro-batch losses, so its loss function scales each micro-batch's summed
    error by 1/(N·outputs), which makes the sum the full batch's mean, our user's loss.
    """
    _, grads = gpipe_job(
        "mlp", 2, [{"chunks": 4, "checkpoint": "always"}], steps=1, batch=8, record_grads=True
    )
    for rc_out in run_ranks("tests/workers/peer_pipelining.py", 2, str(tmp_path), "4", "8", timeout=180):
        check(rc_out)
    peer = {}
    for r in range(2):
        peer.update(torch.load(tmp_path / f"peer_rank{r}.pt"))
    ours = {}
    for rank_grads in grads[0]:
        ours.update(rank_grads[0])
    assert set(ours) == set(peer) == {f"layers.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    assert max_diff(ours, peer) <= 1e-6


@pytest.mark.timeout(300)
def test_gradients_match_torch_pipelining_schedule_1f1b(gpipe_job, tmp_path):
    """schedule="1f1b" against Schedule1F1B: 2 stages, batch 8 in 4 micro-batches, one step.

    The peer's loss function scales each micro-batch's summed error by 1/(N·outputs), so its sum
    is the full batch's mean; ours weights each micro-batch's mean loss by n_i/N: the same total.
    """
    _, grads = gpipe_job(
        "mlp", 2, [{"chunks": 4, "checkpoint": "except_last", "schedule": "1f1b"}], steps=1, batch=8,
        record_grads=True,
    )  # fmt: skip
    for rc_out in run_ranks(
        "tests/workers/peer_pipelining.py", 2, str(tmp_path), "4", "8", "1f1b", timeout=180
    ):
        check(rc_out)
    peer = {}
    for r in range(2):
        peer.update(torch.load(tmp_path / f"peer_rank{r}.pt"))
    ours = {}
    for rank_grads in grads[0]:
        ours.update(rank_grads[0])
    assert set(ours) == set(peer) == {f"layers.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    assert max_diff(ours, peer) <= 1e-6
