"""BatchNorm under the default chunks with ``batch_norm="micro_batch"`` (issue 40, kind E; CPU, Gloo, hard
timeouts): batches of 12 on 2 stages run as 6 micro-batches of 2, never of one sample, each normalized by
its own statistics. The default ``"batch"`` (refused at the first forward) is checked in process:
tests/unit/strategy/test_batch_norm.py; here only that its refusal on one stage ends every rank."""

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


@pytest.mark.timeout(120)
def test_the_refusal_on_the_last_stage_stops_the_first_promptly_naming_the_layer(tmp_path):
    """batch_norm="batch" (the default), chunks=2, 1F1B, balance [1, 5]: the BatchNorm ``layers.1`` is on
    stage 1 only, while stage 0 waits for its gradients; stage 1's PipelineUsageError ends the job (no
    hang until a collective timeout) and stage 0's error names stage 1's refusal."""
    import json

    from tests._harness import run_failing

    spec = {"kind": "bn", "devices": 2, "out": str(tmp_path), "steps": 1}
    spec["runs"] = [{"chunks": 2, "balance": [1, 5], "schedule": "1f1b"}]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = run_failing("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=90)
    refusal = "BatchNorm layer 'layers.1' (stage 1) runs in training mode on a step split into 2"
    assert f"PipelineUsageError: {refusal}" in out
    stopped = "stage 0 (rank 1) stopped because another rank of the job failed (stage 1 (rank 0) failed: "
    assert f"{stopped}PipelineUsageError: {refusal}" in out
