"""torch.compile of the pipelined Sequential: each stage is compiled, losses equal the compiled
model on one device."""

import json

import pytest
import torch

from tests._harness import run_failing
from tests.models import Net, train_single_device

AOT = {"backend": "aot_eager"}


@pytest.mark.timeout(400)
def test_compiled_sequential_and_compile_option_match_compiled_one_device(gpipe_job, tmp_path):
    """2 stages, chunks 2: ``model.layers = torch.compile(model.layers, backend="aot_eager")`` and
    ``GPipeStrategy(compile={"backend": "aot_eager"})`` on the plain model both give the one-device
    compiled model's losses and parameters (≤ 1e-5); the user's compiled wrapper is back after fit.

    Checkpoints cross between the two as they do on one device: one written inside ``fit`` (the
    model partitioned) holds the one-device model's keys (``layers._orig_mod.0.weight`` under the
    user's compile) and loads strictly into it, and a fit resumed from the one-device checkpoint
    continues as the one-device fit does."""
    more = {"max_epochs": 2}  # the resumed fits' two more steps
    references, resumed = [], []
    for k, net in enumerate(({"compile_layers": AOT}, {})):
        reference, trainer = train_single_device("mlp", 0, steps=3, return_trainer=True, **net)
        trainer.save_checkpoint(tmp_path / f"one{k}.ckpt")
        references.append(reference)
        one = str(tmp_path / f"one{k}.ckpt")
        resumed.append(train_single_device("mlp", 0, steps=5, ckpt_path=one, trainer_extra=more, **net))
    runs = [{"chunks": 2, "net": {"compile_layers": AOT}}, {"chunks": 2, "compile": AOT}]
    resume = {"ckpt": str(tmp_path / "one{k}.ckpt"), "steps": 5, "trainer": more}
    during_fit = "during{k}.ckpt"  # written at the end of the first fit, while the model is partitioned
    results, _ = gpipe_job("mlp", 2, runs, steps=3, batch=10, save_at_train_end=during_fit, resume=resume)
    for k, (result, reference, again) in enumerate(zip(results, references, resumed)):
        assert max(abs(a - b) for a, b in zip(result["losses"], reference.losses)) <= 1e-5
        during = torch.load(tmp_path / during_fit.format(k=k), weights_only=False)["state_dict"]
        assert list(during) == list(reference.state_dict())  # "layers._orig_mod.0.weight" under compile
        Net("mlp", **({"compile_layers": AOT} if k == 0 else {})).load_state_dict(during)  # strict
        assert max((during[n] - t).abs().max().item() for n, t in reference.state_dict().items()) <= 1e-5
        assert len(result["resumed_losses"]) == 2 == len(again.losses)
        assert max(abs(a - b) for a, b in zip(result["resumed_losses"], again.losses)) <= 1e-5
        assert max((result["state"][n] - t).abs().max().item() for n, t in again.state_dict().items()) <= 1e-5
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
    out = run_failing("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=150)
    assert "the pipelined module was not called in training_step" in out
