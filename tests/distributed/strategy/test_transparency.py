"""The pipelined module trains exactly like the plain module on one device (torchgpipe's test_transparency),
under the strategy: one process job per schedule family for the Lightning glue (the strategy's
arguments, the logged loss, the parameters Lightning's optimizer steps, both Lightning namespaces).

The mathematics (every K, M, checkpoint mode and schedule; tuple and pytree boundaries, changing
sequence lengths, dropout, BatchNorm) is checked in one process: tests/test_transparency_grid.py.
Every multi-process job runs under a hard timeout (tests/_harness.py kills the whole process group).
"""

import pytest

from lightning_gpipe.engine.microbatch import sizes
from tests.conftest import max_diff
from tests.models import train_single_device

# K = 2: every M of the grid, every checkpoint mode once
COVERING = [(1, "except_last"), (3, "never"), (4, "always")]


@pytest.fixture(scope="module")
def reference():
    return train_single_device("mlp", seed=0, steps=5, batch=10)


def _check_runs(gpipe_job, reference, stages, runs, namespace="pytorch_lightning"):
    results, _ = gpipe_job(
        "mlp",
        stages,
        [{"checkpoint": c} if m is None else {"chunks": m, "checkpoint": c} for m, c in runs],
        steps=5,
        batch=10,
        namespace=namespace,
    )
    ref_state = reference.state_dict()
    for (m, c), result in zip(runs, results):
        assert {r["strategy_class"].split(".")[0] for r in result["ranks"]} == {namespace.split(".")[0]}
        assert len(result["losses"]) == 5
        loss_diff = max(abs(a - b) for a, b in zip(result["losses"], reference.losses))
        assert loss_diff <= 1e-5, f"K={stages} M={m} checkpoint={c}: losses differ by {loss_diff}"
        for record in result[
            "ranks"
        ]:  # what Lightning's logging saw on every rank: the last stage's true loss
            assert record["callback_metrics"]["train_loss"] == pytest.approx(reference.losses[-1], abs=1e-5)
        param_diff = max_diff(result["state"], ref_state)
        assert param_diff <= 1e-5, f"K={stages} M={m} checkpoint={c}: parameters differ by {param_diff}"
    return results


@pytest.mark.timeout(300)
def test_pipeline_matches_single_device(gpipe_job, reference):
    """2 stages, batch 10 (not divisible by 3 or 4), 5 SGD+momentum steps: losses and parameters
    within 1e-5."""
    _check_runs(gpipe_job, reference, 2, COVERING)


@pytest.mark.timeout(300)
def test_import_lightning_namespace_matches_single_device(gpipe_job, reference):
    """``import lightning as L``: L.Trainer, L.LightningModule and the same GPipeStrategy (2 stages)
    train like pytorch_lightning on one device; the strategy runs on lightning.pytorch's base.
    The default ``chunks`` pipelines (M = 4·K = 8, capped by the batch of 10) with the same result,
    and the job prints no warning about collectives on ranks outside their group."""
    results = _check_runs(
        gpipe_job, reference, 2, [*COVERING, (None, "except_last")], namespace="lightning.pytorch"
    )
    assert [r["chunks_used"] for r in results] == [1, 3, 4, 8]
    assert "does not belong to the given group" not in results[0]["output"]


def _bn_stats(state):
    """The running statistics only: weights differ by design (each micro-batch is normalised on its own)."""
    return {k: state[f"layers.1.{k}"] for k in ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.timeout(300)
def test_deferred_batch_norm_running_stats_equal_full_batch(gpipe_job):
    """GPipeStrategy(batch_norm="micro_batch", deferred_batch_norm=True), the glue (the strategy converts
    the BatchNorms and commits them once per step, after the last micro-batch call under 1F1B and
    ZB-H1): Conv-BN-ReLU over 3 stages, batch 16, chunks 4: after one step the running statistics equal
    the one-device full-batch values."""
    reference = train_single_device("cbr", 0, steps=1, batch=16)
    micro = {"chunks": 4, "batch_norm": "micro_batch"}  # GPipe's per-micro-batch statistics, chosen
    runs = [
        {**micro, "checkpoint": "always", "deferred_batch_norm": True},
        {**micro, "checkpoint": "always"},
        {**micro, "checkpoint": "always", "deferred_batch_norm": True, "schedule": "1f1b"},
        {**micro, "checkpoint": "never", "deferred_batch_norm": True, "schedule": "zb_h1"},
    ]
    results, _ = gpipe_job("cbr", 3, runs, steps=1, batch=16)
    deferred, plain = _bn_stats(results[0]["state"]), _bn_stats(results[1]["state"])
    expected = _bn_stats(reference.state_dict())
    assert max_diff(deferred, expected) <= 1e-5
    assert deferred["num_batches_tracked"].item() == 1
    for result in results[2:]:  # 1F1B, ZB-H1: committed once, after the step's last micro-batch call
        stats = _bn_stats(result["state"])
        assert max_diff(stats, expected) <= 1e-5 and stats["num_batches_tracked"].item() == 1
    # Without deferred batch norm the running statistics are those of 4 micro-batch updates, not one
    # full-batch update: num_batches_tracked counts micro-batches and the means differ.
    assert plain["num_batches_tracked"].item() == 4
    assert (plain["running_mean"] - expected["running_mean"]).abs().max() > 1e-3


# -- one call per micro-batch: schedule="1f1b" and "zb_h1" (1F1B with each backward split into B and W)
# K = 2, batch 10 (not divisible by 3, 4 or 8), every checkpoint mode
PER_MICRO_BATCH = [
    (3, "never", "1f1b"),
    (4, "always", "1f1b"),
    (8, "except_last", "1f1b"),
    (3, "never", "zb_h1"),
    (8, "except_last", "zb_h1"),
]


def _check_per_micro_batch_runs(gpipe_job, reference, stages, runs):
    """Per step, the loss every rank's ``callback_metrics`` held (the logged value, combined over the
    micro-batches) and, combined by size, the losses of the step's calls equal the one-device losses;
    the final parameters too; the logger got one value per step."""
    specs = [
        {
            "chunks": m,
            "checkpoint": c,
            "schedule": schedule,
            "record_logs": True,
            "trainer": {"log_every_n_steps": 1},
        }
        for m, c, schedule in runs
    ]
    results, _ = gpipe_job("mlp", stages, specs, steps=5, batch=10)
    ref_state = reference.state_dict()
    for (m, c, schedule), result in zip(runs, results):
        where = f"{schedule} K={stages} M={m} checkpoint={c}"
        parts = sizes(10, m)
        calls = result["losses"]  # the last stage's training_step ran once per micro-batch
        assert len(calls) == 5 * len(parts), where
        combined = [sum(n * calls[s * len(parts) + i] for i, n in enumerate(parts)) / 10 for s in range(5)]
        assert max(abs(a - b) for a, b in zip(combined, reference.losses)) <= 1e-5, where
        for record in result["ranks"]:  # every rank's callback_metrics after each step: the full batch's loss
            assert len(record["synced_losses"]) == 5, where
            diff = max(abs(a - b) for a, b in zip(record["synced_losses"], reference.losses))
            assert diff <= 1e-5, f"{where}: logged train_loss differs by {diff}"
        logged = [entry["train_loss"] for entry in result["logged"] if "train_loss" in entry]
        assert logged == pytest.approx(reference.losses, abs=1e-5), where
        param_diff = max_diff(result["state"], ref_state)
        assert param_diff <= 1e-5, f"{where}: parameters differ by {param_diff}"


@pytest.mark.timeout(300)
def test_1f1b_and_zb_h1_match_single_device(gpipe_job, reference):
    """schedule="1f1b" and "zb_h1" (a recomputed micro-batch's B runs the whole backward and its W
    nothing), 2 stages, 5 SGD+momentum steps: losses (calls combined, and the logged value) and
    parameters within 1e-5."""
    _check_per_micro_batch_runs(gpipe_job, reference, 2, PER_MICRO_BATCH)
