"""balance="parameters" | "time" | "memory" through the strategy: rank 0 profiles, all ranks agree."""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import train_single_device


@pytest.mark.timeout(300)
def test_balancers_choose_one_balance_for_all_ranks_and_train_like_one_device(gpipe_job, tmp_path):
    reference = train_single_device("mlp", 0, steps=3)
    runs = [{"chunks": 2, "balance": how} for how in ("parameters", "time", "memory")]
    # training_step logs before calling the Sequential: the sample capture must tolerate it
    results, _ = gpipe_job("mlp", 3, runs, steps=3, save="balanced.ckpt", net={"log_first": True})
    for result in results:
        assert max_diff(result["state"], reference.state_dict()) <= 1e-5
    saved = torch.load(tmp_path / "balanced.ckpt", weights_only=False)["gpipe"]
    assert saved["balance_by"] == "memory" and sum(saved["balance"]) == 5 and len(saved["balance"]) == 3
    assert all(n >= 1 for n in saved["balance"])


def test_time_balance_is_profiled_once_per_model_and_validate_reuses_it(gpipe_job):
    """balance="time", 2 stages: fit with the loaders passed to fit, then trainer.validate(model, val)
    reuses the balance (no second profile, no train_dataloader needed) and gives one device's val_loss;
    a validate without fit profiles on the validation batch."""
    from tests.models import Net, make_data, pl

    val = make_data("mlp", 10, 2, seed=2)
    reference, ref_trainer = train_single_device("mlp", 0, steps=3, return_trainer=True)
    trained = ref_trainer.validate(reference, val, verbose=False)[0]["val_loss"]
    pl.seed_everything(0, verbose=False)
    untrained = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    untrained = untrained.validate(Net("mlp"), val, verbose=False)[0]["val_loss"]
    runs = [
        {"chunks": 2, "balance": "time", "validate": True},
        {"chunks": 2, "balance": "time", "validate": True, "fit": False},
    ]
    results, _ = gpipe_job("mlp", 2, runs, steps=3)
    assert results[0]["output"].count("gpipe: balance='time' chose") == 2  # run 0's fit, run 1's validate
    for result, expected in zip(results, (trained, untrained)):
        for record in result["ranks"]:
            assert record["validated"][0]["val_loss"] == pytest.approx(expected, abs=1e-5)
