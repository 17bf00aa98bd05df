"""What the user's steps return and log reaches every rank as on one device (CPU, Gloo, hard timeouts):
step outputs in the batch-end hooks, a torchmetrics Metric's step value, token-count losses."""

import json

import pytest
import torch

from tests._harness import check, run_ranks
from tests.conftest import max_diff
from tests.user_code import train


def _job(tmp_path, runs, devices=2, timeout=280):
    """tests/workers/user_code.py over ``runs``; per run, every rank's record (rank 0: the last stage)."""
    spec = {"out": str(tmp_path), "devices": devices, "runs": runs}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    for result in run_ranks(
        "tests/workers/user_code.py", devices, str(tmp_path / "spec.json"), timeout=timeout
    ):
        check(result)
    return [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(devices)]
        for k in range(len(runs))
    ]


def _close(a, b, tol=1e-5):
    """Nested records equal, numbers within ``tol``."""
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(a), sorted(b))
        for k in a:
            _close(a[k], b[k], tol)
    elif isinstance(a, list):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _close(x, y, tol)
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=tol)
    else:
        assert a == b


@pytest.mark.timeout(300)
def test_step_outputs_and_metric_step_values_reach_every_rank_as_on_one_device(tmp_path):
    """2 stages, batches of 8, 4 steps, then validate and test. training_step returns {"loss", "preds",
    "n", "stats": {"mean", "rows", "count"}}; under "gpipe" (chunks 2) and "1f1b" (chunks 3: micro-batches
    3, 3, 2) every rank's on_train_batch_end gets one device's outputs: preds of 8 rows, n = 8, the
    batch's mean, the 8 per-sample rows, the count summed. A MeanAbsoluteError logged on_step and
    on_epoch reports the batch's and the epoch's values on every rank, and so does an R2Score whose forward
    value is logged. on_validation_batch_end and
    on_test_batch_end get the last stage's {"preds", "target"} on every rank. Weights as one device's."""
    reference = train("outputs")
    runs = [
        {"case": "outputs", "strategy": {"chunks": 2}},
        {"case": "outputs", "strategy": {"chunks": 3, "schedule": "1f1b"}},
    ]
    for ranks in _job(tmp_path, runs):
        for record in ranks:
            assert [s["keys"] for s in record["seen"]] == [["loss", "n", "preds", "stats"]] * 4
            _close(record["seen"], reference["seen"])
            _close(record["mae_steps"], reference["mae_steps"])
            _close(record["r2_steps"], reference["r2_steps"])
            _close(record["mae_epoch"], reference["mae_epoch"])
            _close(record["val"], reference["val"])
            _close(record["test"], reference["test"])
            assert record["validated"][0]["val_loss"] == pytest.approx(
                reference["validated"][0]["val_loss"], abs=1e-5
            )
            assert max_diff(record["state"], reference["state"]) <= 1e-5


@pytest.mark.timeout(300)
def test_token_count_loss_trains_and_logs_as_on_one_device_under_every_schedule(tmp_path):
    """The padded SFT loss, a mean over each micro-batch's valid tokens returned with "num_items", 2 stages,
    chunks 4 (some 2-sequence micro-batches hold 3 valid tokens, others 15): under "1f1b" with
    accumulate_grad_batches=2, "interleaved_1f1b" and "zb_h1" the step's loss, the logged train_loss, the
    outputs' num_items on every rank and the trained weights equal one device's."""
    references = {
        accumulate: train("tokens", trainer={"accumulate_grad_batches": accumulate}) for accumulate in (1, 2)
    }
    runs = [
        {
            "case": "tokens",
            "strategy": {"chunks": 4, "schedule": "1f1b"},
            "trainer": {"accumulate_grad_batches": 2},
        },
        {"case": "tokens", "strategy": {"chunks": 4, "schedule": "interleaved_1f1b"}},
        {"case": "tokens", "strategy": {"chunks": 4, "schedule": "zb_h1", "checkpoint": "never"}},
    ]
    for run, ranks in zip(runs, _job(tmp_path, runs)):
        reference = references[run.get("trainer", {}).get("accumulate_grad_batches", 1)]
        for record in ranks:
            _close(record["losses"], reference["losses"])
            _close(record["logged"], reference["logged"])
            assert record["items"] == reference["items"]
            assert max_diff(record["state"], reference["state"]) <= 1e-5, run
