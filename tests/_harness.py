"""Run multi-process jobs from tests, through the tests' launcher (:mod:`tests.launch`).

Every job runs in its own process groups under a hard timeout; a job past it is killed whole and
the test fails with the job's output.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tests.launch import job_env, run_job

ROOT = Path(__file__).resolve().parents[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`tests.launch.job_env` with the repository root on ``PYTHONPATH`` (workers import
    ``tests``)."""
    env = job_env(threads=1)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def run_script(
    script: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``python script args`` (Lightning launches the other ranks itself); kill every rank on timeout."""
    return run_job([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=_env(env), timeout=timeout)[0]


def run_ranks(
    script: str, nprocs: int, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> list[tuple[int, str]]:
    """Start ``nprocs`` copies of ``python script args`` with RANK/WORLD_SIZE set (torchrun-style)."""
    return run_job(
        [sys.executable, str(ROOT / script), *args], ranks=nprocs, cwd=ROOT, env=_env(env), timeout=timeout
    )


def run_failing(script: str, nprocs: int, *args: str, timeout: float = 240) -> str:
    """:func:`run_ranks`, asserting that every rank exits non-zero; returns their outputs joined."""
    results = run_ranks(script, nprocs, *args, timeout=timeout)
    out = "\n".join(out for _, out in results)
    assert all(rc != 0 for rc, _ in results), out[-3000:]
    return out


def check(result: tuple[int, str]) -> str:
    rc, out = result
    assert rc == 0, f"job failed with exit code {rc}:\n{out[-6000:]}"
    return out


def traceback_ends(out: str) -> list[str]:
    """The exception line that ends each ``Traceback (most recent call last):`` block of ``out`` (one
    block per exception of a chain), without torch's ``[rankR]:`` prefix or the module of the
    exception's type (``StageError: ...``): how many times each error's traceback was printed."""
    lines = [re.sub(r"^\[rank\d+\]: ?", "", line) for line in out.splitlines()]
    ends = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            ends += [later for later in lines[i + 1 :] if later and not later[0].isspace()][:1]
    return [re.sub(r"^(?:\w+\.)+(?=\w+: )", "", end) for end in ends]
