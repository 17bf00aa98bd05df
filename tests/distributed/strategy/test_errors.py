"""Misuse gets a clear error: before any process starts where possible, else at the first step."""

import pytest


@pytest.mark.timeout(120)
def test_calling_pipeline_twice_in_a_step_fails_fast(tmp_path):
    import json

    from tests._harness import run_failing

    spec = {
        "kind": "mlp",
        "devices": 2,
        "runs": [{"chunks": 2}],
        "out": str(tmp_path),
        "call_twice": True,
        "steps": 1,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = run_failing("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=90)
    assert "called twice in one step" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["-c", pytest.param("stdin", marks=pytest.mark.slow)])  # one check, 8 s each
def test_python_c_and_stdin_scripts_get_a_clear_error(how):
    """``python -c "..."`` and ``python - < script.py`` cannot be re-run for the other ranks: clear
    error, fast."""
    import subprocess
    import sys

    from tests._harness import ROOT, _env

    code = (
        "import pytorch_lightning as pl, lightning_gpipe\n"
        "from tests.models import Net, make_data, trainer_kwargs\n"
        "pl.Trainer(strategy='gpipe', devices=2, **trainer_kwargs(1))"
        ".fit(Net('mlp'), make_data('mlp', 10, 1))\n"
    )
    args = [sys.executable, "-c", code] if how == "-c" else [sys.executable, "-"]
    proc = subprocess.run(
        args,
        input=None if how == "-c" else code,
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode != 0
    assert "cannot be re-run; save it to a file and run `python file.py`" in proc.stderr, proc.stderr[-3000:]
