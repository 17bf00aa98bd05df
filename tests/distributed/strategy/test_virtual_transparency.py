"""Interleaved 1F1B with virtual stages trains exactly like the plain module on one device, under the
strategy.

The mathematics (K = 2 and 3, every M of the grid and checkpoint mode) is checked in one process:
tests/test_transparency_grid.py and tests/test_virtual_stage.py.

Every multi-process job runs under a hard timeout (tests/_harness.py kills the whole process group).
"""

import pytest
import torch

from lightning_gpipe.engine.microbatch import sizes
from tests.conftest import max_diff
from tests.models import Net, train_single_device

# K = 2, v = 2: the 5-layer MLP in 4 parts; every checkpoint mode; M = 3 has one micro-batch group of
# 3 (its stages exchange messages out of send order) and M = 1 fewer micro-batches than stages
RUNS = [(1, "never"), (3, "always"), (4, "except_last"), (8, "never")]


@pytest.fixture(scope="module")
def reference():
    return train_single_device("mlp", seed=0, steps=5, batch=10)


@pytest.mark.timeout(400)
def test_interleaved_1f1b_with_two_virtual_stages_matches_single_device(gpipe_job, reference):
    """Batch 10 (not divisible by 3, 4 or 8), 5 SGD+momentum steps: per step the losses of the calls
    combined by size, and the logged loss on every rank, equal one device's; the final parameters
    (gathered from the stages' parts under the user's names) too, all within 1e-5."""
    specs = [
        {
            "chunks": m,
            "checkpoint": c,
            "schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "record_logs": True,
            "trainer": {"log_every_n_steps": 1},
        }
        for m, c in RUNS
    ]
    results, _ = gpipe_job("mlp", 2, specs, steps=5, batch=10)
    ref_state = reference.state_dict()
    assert "gpipe: 2 stages × 2 virtual stages over 5 layers" in results[0]["output"]  # the placement logged
    for (m, c), result in zip(RUNS, results):
        where = f"K=2 v=2 M={m} checkpoint={c}"
        parts = sizes(10, m)
        calls = result["losses"]  # the last stage's training_step ran once per micro-batch
        assert len(calls) == 5 * len(parts), where
        combined = [sum(n * calls[s * len(parts) + i] for i, n in enumerate(parts)) / 10 for s in range(5)]
        assert max(abs(a - b) for a, b in zip(combined, reference.losses)) <= 1e-5, where
        for record in result["ranks"]:
            diff = max(abs(a - b) for a, b in zip(record["synced_losses"], reference.losses))
            assert diff <= 1e-5, f"{where}: logged train_loss differs by {diff}"
        param_diff = max_diff(result["state"], ref_state)
        assert param_diff <= 1e-5, f"{where}: parameters differ by {param_diff}"


@pytest.mark.slow  # about 30 s: three jobs; tests/test_virtual_partition.py checks every layout in-process
@pytest.mark.timeout(400)
def test_checkpoint_saved_with_virtual_stages_loads_into_the_plain_module_and_another_layout(
    gpipe_job, tmp_path
):
    """Save after 2 steps with K=2, v=2 (4 parts); the file is a standard checkpoint in the user's names:
    it loads strictly into the plain module, equals one device's, and resumes to step 5 under K=3
    without virtual stages, and on one device, like one device's own checkpoint."""
    gpipe_job(
        "mlp",
        2,
        [{"chunks": 3, "schedule": "interleaved_1f1b", "virtual_stages": 2}],
        steps=2,
        save="virtual.ckpt",
        trainer={"max_epochs": 3},
    )
    ckpt = torch.load(tmp_path / "virtual.ckpt", weights_only=False)
    assert (ckpt["gpipe"]["stages"], ckpt["gpipe"]["virtual_stages"], len(ckpt["gpipe"]["balance"])) == (
        2,
        2,
        4,
    )
    Net("mlp").load_state_dict(ckpt["state_dict"], strict=True)
    _, trainer = train_single_device("mlp", 0, steps=2, return_trainer=True, trainer_extra={"max_epochs": 3})
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    one = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert list(ckpt["state_dict"]) == list(one["state_dict"])
    assert max_diff(ckpt["state_dict"], one["state_dict"]) <= 1e-5
    resumed = train_single_device(
        "mlp", 0, steps=5, ckpt_path=str(tmp_path / "one.ckpt"), trainer_extra={"max_epochs": 3}
    )
    results, _ = gpipe_job(
        "mlp",
        3,
        [{"chunks": 2}],
        steps=2,
        fit=False,
        resume={"ckpt": str(tmp_path / "virtual.ckpt"), "steps": 5},
        trainer={"max_epochs": 3},
    )
    assert max(abs(a - b) for a, b in zip(results[0]["resumed_losses"], resumed.losses)) <= 1e-5
    assert max_diff(results[0]["state"], resumed.state_dict()) <= 1e-5
    cross = train_single_device(
        "mlp", 0, steps=5, ckpt_path=str(tmp_path / "virtual.ckpt"), trainer_extra={"max_epochs": 3}
    )
    assert max_diff(cross.state_dict(), resumed.state_dict()) <= 1e-5
