"""torch.compile of the pipelined Sequential: each stage is compiled, losses equal the compiled
model on one device."""

import json

import pytest

from tests._harness import run_script
from tests.models import train_single_device

AOT = {"backend": "aot_eager"}


def _plain_names(state):
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


@pytest.mark.timeout(400)
def test_compiled_sequential_and_compile_option_match_compiled_one_device(gpipe_job):
    """2 stages, chunks 2: ``model.layers = torch.compile(model.layers, backend="aot_eager")`` and
    ``GPipeStrategy(compile={"backend": "aot_eager"})`` on the plain model both give the one-device
    compiled model's losses and parameters (≤ 1e-5); the user's compiled wrapper is back after fit."""
    reference = train_single_device("mlp", 0, steps=3, compile_layers=AOT)
    runs = [{"chunks": 2, "net": {"compile_layers": AOT}}, {"chunks": 2, "compile": AOT}]
    results, _ = gpipe_job("mlp", 2, runs, steps=3, batch=10)
    ref_state = _plain_names(reference.state_dict())
    for result in results:
        assert max(abs(a - b) for a, b in zip(result["losses"], reference.losses)) <= 1e-5
        state = _plain_names(result["state"])
        assert max((state[k] - ref_state[k]).abs().max().item() for k in ref_state) <= 1e-5
    assert any("_orig_mod." in k for k in results[0]["state"])  # the user's wrapper is back
    for result in results:
        assert [r["stage_compiled"] for r in result["ranks"]] == [True, True]


@pytest.mark.timeout(200)
def test_step_that_bypasses_the_pipeline_fails_at_the_first_step(tmp_path):
    """A reference to the Sequential's forward kept from __init__ runs the whole model on every rank:
    it must fail at the first step, never train silently."""
    spec = {"kind": "mlp", "devices": 2, "runs": [{"chunks": 2}], "out": str(tmp_path)}
    spec["net"] = {"stale_forward": True}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    rc, out = run_script("tests/workers/train.py", str(tmp_path / "spec.json"), timeout=150)
    assert rc != 0
    assert "the pipelined module was not called in training_step" in out
