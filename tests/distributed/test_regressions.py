"""Regressions: unusual but valid inputs and usage, each against the one-device value."""

import json

import pytest
import pytorch_lightning as pl
import torch

from tests._harness import check, run_script
from tests.conftest import max_diff
from tests.models import alternate, train_single_device


@pytest.mark.slow  # about 30 s
@pytest.mark.timeout(300)
def test_val_val_train_val_alternation_matches_one_device(tmp_path):
    """20 rounds of validate, validate, one training step, validate (chunks 4, 3 stages, fresh Trainers)."""
    check(run_script("tests/workers/alternate.py", str(tmp_path), "3", "4", "20", timeout=280))
    ours = torch.load(tmp_path / "alternate.pt", weights_only=False)
    ref_model, ref_losses = alternate(lambda **kw: pl.Trainer(devices=1, **kw), 20)
    assert len(ours["val_losses"]) == len(ref_losses) == 60
    assert max(abs(a - b) for a, b in zip(ours["val_losses"], ref_losses)) <= 1e-4
    assert max_diff(ours["state"], ref_model.state_dict()) <= 1e-4


@pytest.mark.timeout(300)
def test_last_batch_smaller_than_chunks(gpipe_job):
    """23 samples in batches of 10: the last batch (3) is smaller than chunks (4)."""
    reference = train_single_device("mlp", 0, steps=3, data={"samples": 23})
    results, _ = gpipe_job("mlp", 2, [{"chunks": 4, "checkpoint": "always"}], steps=3, samples=23)
    assert [s[0] for s in results[0]["shapes"]] == [10, 10, 3]
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference.losses)) <= 1e-5
    assert max_diff(results[0]["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(300)
def test_integer_only_input_to_the_first_stage(gpipe_job):
    """Token ids (long) are the whole input of stage 0: they are split and never get gradients."""
    reference = train_single_device("ids", 0, steps=3, record_grads=True)
    results, grads = gpipe_job("ids", 2, [{"chunks": 3, "checkpoint": "always"}], steps=3, record_grads=True)
    assert max_diff(results[0]["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(200)
def test_detect_anomaly_names_the_stage(tmp_path):
    """Trainer(detect_anomaly=True): a NaN made in stage 1's backward is reported with that stage."""
    import json

    spec = {
        "kind": "mlp",
        "devices": 3,
        "runs": [{"chunks": 2, "checkpoint": "never"}],
        "out": str(tmp_path),
        "fail": {"layer": 2, "where": "nan_backward", "at": 1},
        "trainer": {"detect_anomaly": True},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    rc, out = run_script("tests/workers/train.py", str(tmp_path / "spec.json"), timeout=150)
    assert rc != 0
    first = next(line for line in out.splitlines() if "[lightning_gpipe]" in line)
    assert first.startswith("[lightning_gpipe] stage 1 (rank 1) failed") and "nan" in first.lower(), first


@pytest.mark.timeout(300)
def test_every_process_group_is_destroyed_before_interpreter_exit(gpipe_job, tmp_path):
    """CI, 2026-11-29: a job that succeeded exited with SIGABRT ("terminate called without an active
    exception"): a Gloo thread still freeing the last collective's tensors needed the GIL during
    interpreter finalization. At exit no group is left and no native thread runs beside Python's."""
    gpipe_job(
        "mlp",
        3,
        [{"chunks": 2}],
        steps=2,
        val=True,
        exit_check=True,
        save="a.ckpt",
        resume={"ckpt": str(tmp_path / "a.ckpt"), "steps": 3},
    )
    for rank in range(3):
        state = json.loads((tmp_path / f"exit_rank{rank}.json").read_text())
        assert state["initialized"] is False, (rank, state)
        assert state["os_threads"] == len(state["python_threads"]), (rank, state)
