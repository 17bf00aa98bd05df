"""The last stage's step outcome reaches every stage before any hook runs (CPU, Gloo, hard timeouts)."""

import pytest

from tests.conftest import max_diff
from tests.models import train_single_device


@pytest.mark.timeout(300)
def test_plateau_scheduler_and_stop_decided_on_last_stage_reach_every_stage(gpipe_job):
    """2 stages, chunks 2: ReduceLROnPlateau on train_loss with interval "step" (strict) halves the learning
    rate after every step on every stage; on_train_batch_end reads the current step's train_loss
    everywhere; should_stop set in training_step after the pipelined call (last stage only) stops every
    stage after the same step. All as on one device."""
    net = {"plateau": True, "stop_at": 3}
    reference, ref_trainer = train_single_device(
        "mlp", 0, steps=6, return_trainer=True, data={"samples": 50}, **net
    )
    assert reference.step_lrs == [0.1, 0.05, 0.025, 0.0125] and ref_trainer.global_step == 4
    results, _ = gpipe_job("mlp", 2, [{"chunks": 2}], steps=6, net=net)
    r = results[0]
    for rank in r["ranks"]:
        assert rank["step_lrs"] == pytest.approx(reference.step_lrs)
        assert rank["global_step"] == 4
        assert rank["synced_losses"] == pytest.approx(reference.losses, abs=1e-6)
    assert max_diff(r["state"], reference.state_dict()) <= 1e-5
