"""The last stage's step outcome reaches every stage before any hook runs (CPU, Gloo, hard timeouts)."""

import pytest

from tests.conftest import max_diff
from tests.models import StopProbe, train_single_device


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


@pytest.mark.timeout(120)
def test_stop_decided_in_validation_step_on_last_stage_reaches_every_stage(gpipe_job):
    """2 stages, chunks 2, validation every 2 training batches (2 val batches), max_steps 10: validation_step
    sets should_stop after its loss (last stage only) at global step 4, val batch 0. A callback's
    on_validation_batch_end reads should_stop == True right after that batch on every rank, and every rank
    stops at global step 4 with the one-device losses, as on one device."""
    net = {"val_stop_at": [4, 0]}
    extra = {"val_check_interval": 2}
    reference, ref_trainer = train_single_device(
        "mlp",
        0,
        steps=10,
        val=True,
        trainer_extra=extra,
        callbacks=(StopProbe(),),
        return_trainer=True,
        data={"samples": 100},
        **net,
    )
    seen = next(c for c in ref_trainer.callbacks if isinstance(c, StopProbe)).seen
    assert seen == [(2, 0, False), (2, 1, False), (4, 0, True), (4, 1, True)]
    assert ref_trainer.global_step == 4
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 2, "features": {"stop_probe": {}}}],
        timeout=90,
        steps=10,
        samples=100,
        val=True,
        trainer=extra,
        net=net,
    )
    r = results[0]
    for rank in r["ranks"]:
        assert rank["stop_probe"] == seen
        assert rank["global_step"] == 4
    assert r["losses"] == pytest.approx(reference.losses, abs=1e-6)
    assert max_diff(r["state"], reference.state_dict()) <= 1e-5
