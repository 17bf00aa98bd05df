"""A collective reached by only some ranks fails within collective_timeout on every rank, naming the
operation and the missing ranks; SIGTERM ends every rank within seconds even while one is blocked."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests._harness import ROOT, _env, _wait, run_script


def _spec(tmp_path, **extra):
    spec = {"kind": "mlp", "devices": 2, "out": str(tmp_path), "steps": 5, **extra}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return str(tmp_path / "spec.json")


@pytest.mark.timeout(200)
def test_checkpoint_saved_only_on_global_zero_fails_fast_on_every_rank(tmp_path):
    """A callback guarded by trainer.is_global_zero saves a checkpoint: with collective_timeout=5 every rank
    exits non-zero within a minute, and the error names the operation and the rank that did not come."""
    path = _spec(
        tmp_path, runs=[{"chunks": 2, "collective_timeout": 5}], rank0_only={"at": 1, "call": "save"}
    )
    start = time.monotonic()
    rc, out = run_script("tests/workers/train.py", path, timeout=150)
    seconds = time.monotonic() - start
    assert rc != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end"
    assert (
        "gathering the model's state (save_checkpoint" in out
        and "rank(s) [1] did not reach it within 5 s" in out
    )
    assert "worker rank" not in out  # no rank finished normally


@pytest.mark.timeout(120)
def test_sigterm_ends_every_rank_while_one_is_blocked_in_a_collective(tmp_path):
    """Rank 0 alone enters a barrier (collective_timeout 600 s, so it stays blocked); SIGTERM to the
    launching process ends both ranks within seconds."""
    path = _spec(
        tmp_path, runs=[{"chunks": 2, "collective_timeout": 600}], rank0_only={"at": 1, "call": "barrier"}
    )
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/workers/train.py"), path],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while not (tmp_path / "blocked").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "rank 0 never reached the barrier"
        time.sleep(0.2)
    time.sleep(2)  # inside the barrier by now
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    ((rc, out),) = _wait([proc], 40)
    seconds = time.monotonic() - start
    assert rc != 0
    assert seconds < 20, f"the ranks took {seconds:.0f} s to end after SIGTERM:\n{out[-3000:]}"
