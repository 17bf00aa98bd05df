"""The strategy trains exactly like the plain module on one device (torchgpipe's test_transparency),
through Lightning: one multi-process job per schedule family (the engine's grid of K, M, checkpoint
modes and schedules, tuple, pytree and sequence-length boundaries, dropout and BatchNorm run in one
process: tests/unit/engine/test_transparency.py).

Every multi-process job runs under a hard timeout (tests/_harness.py kills the whole process group).
"""

import itertools

import pytest

from lightning_gpipe.engine.microbatch import sizes
from tests.conftest import max_diff
from tests.models import train_single_device

MODES = ["always", "except_last", "never"]
# Every K with every M, every checkpoint mode at least once per K (the default run).
COVERING = {
    1: [(1, "never"), (3, "always"), (4, "except_last")],
    2: [(1, "except_last"), (3, "never"), (4, "always")],
    3: [(1, "always"), (3, "except_last"), (4, "never")],
}
FULL = {
    k: [(m, c) for m, c in itertools.product([1, 3, 4], MODES) if (m, c) not in COVERING[k]]
    for k in (1, 2, 3)
}


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
def test_import_lightning_namespace_matches_single_device(gpipe_job, reference):
    """``import lightning as L``: L.Trainer, L.LightningModule and the same GPipeStrategy (2 stages)
    train like pytorch_lightning on one device; the strategy runs on lightning.pytorch's base.
    The default ``chunks`` pipelines (M = 4·K = 8, capped by the batch of 10) with the same result,
    and the job prints no warning about collectives on ranks outside their group."""
    results = _check_runs(
        gpipe_job, reference, 2, [*COVERING[2], (None, "except_last")], namespace="lightning.pytorch"
    )
    assert [r["chunks_used"] for r in results] == [1, 3, 4, 8]
    assert "does not belong to the given group" not in results[0]["output"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipeline_matches_single_device_full_grid(gpipe_job, reference, stages):
    _check_runs(gpipe_job, reference, stages, FULL[stages])


def _grads_match_reference(grads_per_rank, reference):
    """Each rank's per-step gradients (its own stage's parameters) equal the one-device gradients."""
    worst = 0.0
    for rank_grads in grads_per_rank:
        assert len(rank_grads) == len(reference.grads)
        for ours, ref in zip(rank_grads, reference.grads):
            worst = max(worst, max_diff(ours, {k: ref[k] for k in ours}))
    names = set().union(*(g[0].keys() for g in grads_per_rank))
    assert names == set(reference.grads[0]), "every parameter got a gradient on exactly one stage"
    return worst


def _bn_stats(state):
    """The running statistics only: weights differ by design (each micro-batch is normalised on its own)."""
    return {k: state[f"layers.1.{k}"] for k in ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.timeout(300)
def test_deferred_batch_norm_running_stats_equal_full_batch(gpipe_job):
    """Conv-BN-ReLU over 3 stages, batch 16, chunks 4, recompute always: after one step the running
    statistics equal the one-device full-batch values."""
    reference = train_single_device("cbr", 0, steps=1, batch=16)
    runs = [
        {"chunks": 4, "checkpoint": "always", "deferred_batch_norm": True},
        {"chunks": 4, "checkpoint": "always"},
        {"chunks": 4, "checkpoint": "always", "deferred_batch_norm": True, "schedule": "1f1b"},
        {"chunks": 4, "checkpoint": "never", "deferred_batch_norm": True, "schedule": "zb_h1"},
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


# -- schedule="1f1b": training_step once per micro-batch ------------------------------------------
# Every M with every K, every checkpoint mode at least once per K; the default run covers K = 2.
ONE_F_ONE_B = {
    2: [(3, "never"), (4, "always"), (8, "except_last")],
    3: [(1, "always"), (3, "except_last"), (4, "never"), (8, "always")],
}
ONE_F_ONE_B_FULL = {
    k: [(m, c) for m, c in itertools.product([1, 3, 4, 8], MODES) if (m, c) not in ONE_F_ONE_B.get(k, [])]
    for k in (2, 3)
}


def _check_1f1b_runs(gpipe_job, reference, stages, runs, schedule="1f1b"):
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
        for m, c in runs
    ]
    results, _ = gpipe_job("mlp", stages, specs, steps=5, batch=10)
    ref_state = reference.state_dict()
    for (m, c), result in zip(runs, results):
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
def test_1f1b_matches_single_device(gpipe_job, reference):
    """schedule="1f1b", 2 stages, batch 10 (not divisible by 3, 4 or 8), 5 SGD+momentum steps, every
    checkpoint mode: losses (calls combined, and the logged value) and parameters within 1e-5."""
    _check_1f1b_runs(gpipe_job, reference, 2, ONE_F_ONE_B[2])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stages", [2, 3])
def test_1f1b_matches_single_device_full_grid(gpipe_job, reference, stages):
    """K in {2, 3}, M in {1, 3, 4, 8}, every checkpoint mode (one job per K)."""
    _check_1f1b_runs(gpipe_job, reference, stages, ONE_F_ONE_B[stages] + ONE_F_ONE_B_FULL[stages])


# -- schedule="zb_h1": 1F1B with each backward split into B (input gradient) and W (weights) --------
@pytest.mark.timeout(300)
def test_zb_h1_matches_single_device(gpipe_job, reference):
    """schedule="zb_h1", K = 3, batch 10, 5 steps: M in {1, 3, 4, 8} in one job, every
    checkpoint mode (a recomputed micro-batch's B runs the whole backward and its W nothing): losses
    and parameters within 1e-5 of the one-device run."""
    _check_1f1b_runs(
        gpipe_job,
        reference,
        3,
        [(1, "never"), (3, "except_last"), (4, "always"), (8, "never")],
        schedule="zb_h1",
    )
