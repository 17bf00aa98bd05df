import pytest
import torch

from tests._harness import check, run_ranks


@pytest.mark.timeout(120)
def test_grad_scaler_found_inf_is_agreed_by_all_stages(tmp_path):
    """An inf on one rank makes every rank skip that step, also where it lies in one rank's shard of a
    ``DTensor`` gradient (FSDP, tensor parallel); the scale stays identical everywhere."""
    for result in run_ranks("tests/workers/scaler.py", 2, str(tmp_path), timeout=100):
        check(result)
    r0, r1 = (torch.load(tmp_path / f"scaler_rank{r}.pt") for r in range(2))
    for a, b in zip(r0, r1):
        assert torch.equal(a["param"], b["param"]) and a["scale"] == b["scale"]
    # step 0 steps (grad 2 → param 1 - 0.1·2), step 1 is skipped by both, step 2 steps again
    assert torch.allclose(r0[0]["param"], torch.full((3,), 0.8))
    assert torch.equal(r0[1]["param"], r0[0]["param"])
    assert torch.allclose(r0[2]["param"], torch.full((3,), 0.6))
    assert [r["scale"] for r in r0] == [1024.0, 512.0, 512.0, 256.0, 256.0]
    for a, b in zip(r0, r1):
        assert torch.equal(a["sharded"], b["sharded"])
    # the sharded parameter steps at 0, 2 and 4 only (its gradient 2 each time), skipped at 1 and 3
    expected = [0.8, 0.8, 0.6, 0.6, 0.4]
    for record, value in zip(r0, expected):
        assert torch.allclose(record["sharded"], torch.full((4,), value))
    assert torch.equal(r0[3]["param"], r0[2]["param"])
