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
