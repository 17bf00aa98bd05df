"""The launching rank's child observer: it ends a job whose child failed only while a launch runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lightning_gpipe.strategy import observer

_SCRIPT = textwrap.dedent(
    """
    import importlib.util, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("observer", sys.argv[1])
    observer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(observer)
    in_launch = sys.argv[2] == "in-launch"
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    observer.ChildObserver([child], grace=0.3, in_launch=lambda: in_launch, period=0.05).start()
    time.sleep(2.0)
    print("went on")
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where, code", [("in-launch", -9), ("after-launch", 0)])
def test_a_failed_child_ends_the_launching_process_only_inside_a_launch(where, code):
    """A child exits with code 3: inside a launch the job is ended after the grace (SIGKILL, saying
    why); once the failure has reached the launching process and its script goes on (a caught
    ``fit``), the process is left to run."""
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, observer.__file__, where], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == code, run.stderr
    if code:
        assert "local rank 1" in run.stderr and "exited with code 3" in run.stderr
    else:
        assert "went on" in run.stdout and "ending it" not in run.stderr
