"""Run multi-process jobs from tests: every job in its own process group, under a hard timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PL_DISABLE_FORK="1",
    )
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process and for every process it started (its process group) to end."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, out))
        for p in procs:  # ranks started by Lightning's launcher live in the same process group
            while _group_alive(p.pid):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(str(p.args), timeout)
                time.sleep(0.2)
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate()[0] for p in procs]
        raise AssertionError(f"job exceeded its {timeout} s timeout; output:\n" + "\n".join(outs)) from None
    return results


def run_script(
    script: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``python script args`` (Lightning launches the other ranks itself); kill every rank on timeout."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *args],
        cwd=ROOT,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return _wait([proc], timeout)[0]


def run_ranks(script: str, nprocs: int, *args: str, timeout: float = 240) -> list[tuple[int, str]]:
    """Start ``nprocs`` copies of ``python script args`` with RANK/WORLD_SIZE set (torchrun-style)."""
    env = _env()
    procs = []
    for rank in range(nprocs):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / script), *args],
                cwd=ROOT,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return _wait(procs, timeout)


def check(result: tuple[int, str]) -> str:
    rc, out = result
    assert rc == 0, f"job failed with exit code {rc}:\n{out[-6000:]}"
    return out
