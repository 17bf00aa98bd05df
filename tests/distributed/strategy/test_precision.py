import pytest
import torch

from tests._harness import check, run_ranks


@pytest.mark.timeout(120)
def test_grad_scaler_found_inf_is_agreed_by_all_stages(tmp_path):
    """An inf on one rank makes every rank skip that step; the scale stays identical everywhere."""
    for result in run_ranks("tests/workers/scaler.py", 2, str(tmp_path), timeout=100):
        check(result)
    r0, r1 = (torch.load(tmp_path / f"scaler_rank{r}.pt") for r in range(2))
    for a, b in zip(r0, r1):
        assert torch.equal(a["param"], b["param"]) and a["scale"] == b["scale"]
    # step 0 steps (grad 2 → param 1 - 0.1·2), step 1 is skipped by both, step 2 steps again
    assert torch.allclose(r0[0]["param"], torch.full((3,), 0.8))
    assert torch.equal(r0[1]["param"], r0[0]["param"])
    assert torch.allclose(r0[2]["param"], torch.full((3,), 0.6))
    assert [r["scale"] for r in r0] == [1024.0, 512.0, 512.0]
