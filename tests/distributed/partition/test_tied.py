"""Tied weights across stages train like one device (lightning_gpipe.partition.tied).

Every multi-process job runs under a hard timeout (tests/_harness.py kills the whole process group).
"""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import Net, train_single_device

CLIP = {
    "gradient_clip_val": 0.05
}  # small enough to clip every step: the norm must count the tied weight once


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "stages", [pytest.param(2, marks=pytest.mark.slow), 3]
)  # 3 stages: a stage between the ties
def test_tied_embedding_and_head_train_like_one_device(gpipe_job, tmp_path, stages):
    """Losses and parameters within 1e-5 of one device, with norm clipping; the copies bitwise equal
    every step."""
    reference = train_single_device("tied", seed=0, steps=5, batch=10, trainer_extra=CLIP)
    runs = [{"chunks": 4, "checkpoint": "except_last"}, {"chunks": 1, "checkpoint": "always"}]
    results, _ = gpipe_job(
        "tied", stages, runs, steps=5, batch=10, trainer=CLIP, record_params=True, save="tied.ckpt"
    )
    for run, result in zip(runs, results):
        loss_diff = max(abs(a - b) for a, b in zip(result["losses"], reference.losses))
        assert loss_diff <= 1e-5, f"K={stages} {run}: losses differ by {loss_diff}"
        state = result["state"]
        assert max_diff(state, reference.state_dict()) <= 1e-5, f"K={stages} {run}: parameters differ"
        first, last = result["ranks"][-1], result["ranks"][0]  # rank 0 holds the last stage
        assert len(first["params"]) == len(last["params"]) == 5
        for before, after in zip(first["params"], last["params"]):
            assert torch.equal(before["layers.0.weight"], after["layers.4.weight"])
    saved = torch.load(tmp_path / "tied.ckpt", weights_only=False)["state_dict"]  # the last run's
    assert saved["layers.4.weight"].data_ptr() == saved["layers.0.weight"].data_ptr()  # stored once
    model = Net("tied")
    model.load_state_dict(saved, strict=True)
    assert model.layers[4].weight is model.layers[0].weight


@pytest.mark.timeout(400)
def test_tied_checkpoint_holds_one_optimizer_state_and_resumes_like_one_device(gpipe_job, tmp_path):
    """Save after 2 steps over 3 stages (inside fit and after): the optimizer state lists the tied
    weight once, where one device does;
    resuming to step 5 (its copy on the last stage takes the owner's state) equals the same resume on
    one device."""
    results, _ = gpipe_job(
        "tied", 3, [{"chunks": 3}], steps=2, save="two.ckpt", save_at_train_end="inside.ckpt",
        resume={"ckpt": str(tmp_path / "two.ckpt"), "steps": 5}, trainer={"max_epochs": 3},
    )  # fmt: skip
    ckpt = torch.load(tmp_path / "two.ckpt", weights_only=False)
    _, trainer = train_single_device("tied", 0, steps=2, return_trainer=True, trainer_extra={"max_epochs": 3})
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    one = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert max_diff(ckpt["state_dict"], one["state_dict"]) <= 1e-5
    plain = one["optimizer_states"][0]
    inside = torch.load(tmp_path / "inside.ckpt", weights_only=False)  # written while partitioned
    for saved in (ckpt, inside):
        mine = saved["optimizer_states"][0]
        assert mine["param_groups"][0]["params"] == plain["param_groups"][0]["params"] == [0, 1, 2]
        assert mine["gpipe_param_names"] == ["layers.0.weight", "layers.2.weight", "layers.2.bias"]
        for k in plain["state"]:
            torch.testing.assert_close(mine["state"][k], plain["state"][k], rtol=0, atol=1e-5)
    resumed = train_single_device(
        "tied", 0, steps=5, ckpt_path=str(tmp_path / "one.ckpt"), trainer_extra={"max_epochs": 3}
    )
    assert abs(results[0]["resumed_losses"][0] - resumed.losses[0]) <= 1e-5  # the weights load exactly
    resume_diff = max(abs(a - b) for a, b in zip(results[0]["resumed_losses"], resumed.losses))
    assert resume_diff <= 1e-5, f"resumed losses differ by {resume_diff}"
    assert max_diff(results[0]["state"], resumed.state_dict()) <= 1e-5
