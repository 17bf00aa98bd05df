"""After a failed ``fit`` that the script catches, the next ``fit``, ``validate`` in the same processes
start clean and equal one device (issue 40, d12: a retry loop, a notebook cell, a tuner trial)."""

import json

import pytest
import torch

from tests._harness import check, run_script
from tests.conftest import max_diff
from tests.models import Net, make_data, pl, train_single_device


# about 25 s: one launch through Lightning's launcher (as the user's script runs) with five entry calls
@pytest.mark.timeout(240)
def test_fit_and_validate_after_a_caught_failure_equal_one_device(tmp_path):
    runs = [
        # stage 0 (rank 1, the rank the launcher started) fails in step 2: rank 0 stops as its peer
        {"chunks": 2, "net": {"fail": {"layer": 0, "where": "forward", "at": 3}}, "caught": True},
        {"chunks": 2, "fit": False, "validate": True},  # validate after the failed fit
        {"chunks": 2, "missing_ckpt": True, "caught": True},  # every rank fails at the same point
        {"chunks": 2},  # fit after a failure
        {"chunks": 2, "schedule": "1f1b", "validate": True},  # fit after a fit that succeeded
    ]
    spec = {"kind": "mlp", "devices": 2, "out": str(tmp_path), "steps": 3, "runs": runs}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    output = check(run_script("tests/workers/train.py", str(tmp_path / "spec.json"), timeout=200))
    records = [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in (0, 1)] for k in range(5)
    ]

    first, missing = records[0], records[2]
    assert "injected failure in forward call 3" in first[1]["caught"], first[1]["caught"]
    assert "stopped because" in first[0]["caught"], first[0]["caught"]
    assert all(r["caught"].startswith("FileNotFoundError") for r in missing), [r["caught"] for r in missing]
    assert "Connection refused" not in output

    val = make_data("mlp", 10, 2, seed=2)
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    pl.seed_everything(0, verbose=False)
    untrained = pl.Trainer(**quiet).validate(Net("mlp"), val, verbose=False)[0]["val_loss"]
    reference, ref_trainer = train_single_device("mlp", 0, steps=3, return_trainer=True)
    trained = ref_trainer.validate(reference, val, verbose=False)[0]["val_loss"]
    for record in records[1]:
        assert record["validated"][0]["val_loss"] == pytest.approx(untrained, abs=1e-5)
    for k in (3, 4):
        assert records[k][0]["global_step"] == 3 and records[k][0]["caught"] is None
        assert max_diff(records[k][0]["state"], reference.state_dict()) <= 1e-5
    for record in records[4]:
        assert record["validated"][0]["val_loss"] == pytest.approx(trained, abs=1e-5)
