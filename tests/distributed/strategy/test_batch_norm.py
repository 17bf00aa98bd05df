"""BatchNorm under the default chunks with ``batch_norm="micro_batch"`` (issue 40, kind E; CPU, Gloo, hard
timeouts): batches of 12 on 2 stages run as 6 micro-batches of 2, never of one sample, each normalized by
its own statistics. The default ``"batch"`` (refused at the first forward) is checked in process:
tests/unit/strategy/test_batch_norm.py."""

import pytest

from tests.conftest import max_diff
from tests.distributed.strategy.test_step_outputs import _close
from tests.user_code import train


@pytest.mark.timeout(300)
def test_default_chunks_keep_two_samples_per_micro_batch_under_gpipe_and_1f1b(kinds_job):
    """An MLP with two BatchNorm1d (float64), batch_norm="micro_batch", batches of 12, chunks=None (4·K =
    8, which would give micro-batches 2, 2, 2, 2, 1, 1, 1, 1 and a BatchNorm1d error): under "gpipe" and
    "1f1b" it trains
    for 4 steps, and its losses (gpipe), weights and running statistics equal one device applying
    the Sequential to each 2-sample slice of the batch (GPipe's per-micro-batch statistics)."""
    reference = train("batchnorm")
    _close(kinds_job["batchnorm_gpipe"][0]["losses"], reference["losses"])
    for name in ("batchnorm_gpipe", "batchnorm_1f1b"):
        for record in kinds_job[name]:
            assert max_diff(record["state"], reference["state"]) <= 1e-9, name
