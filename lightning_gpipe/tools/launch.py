"""Start multi-process jobs under a hard timeout: a job of ranks, each in a process group of its own.

A job is one command started once (Lightning's launcher starts the other ranks itself) or once
per rank with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, as ``torchrun`` does. Every started
process leads a process group of its own (``start_new_session``), so on timeout the whole job,
ranks started by Lightning included, is killed with one ``killpg`` per process, and a job is
over only when no process of those groups is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["JobTimeout", "free_port", "group_alive", "job_env", "run_job", "run_processes"]

# What a launcher sets for its ranks; removed from the job's environment so that a job started from
# inside another job (a test under torchrun, a benchmark in a Lightning process) starts afresh.
RANK_KEYS = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
)


class JobTimeout(RuntimeError):
    """A job ran past its timeout and was killed; the message holds every process's output."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_env(threads: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a fresh job on this machine.

    ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` (:func:`free_port`),
    ``OMP_NUM_THREADS=threads``, unbuffered output, Lightning's fork-based launching off
    (``PL_DISABLE_FORK=1``), no rank variables of an enclosing job (:data:`RANK_KEYS`), then
    ``extra``.
    """
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        PL_DISABLE_FORK="1",
    )
    for key in RANK_KEYS:
        env.pop(key, None)
    env.update(extra or {})
    return env


def group_alive(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` is still alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_job(
    command: Sequence[str],
    *,
    ranks: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 240.0,
) -> list[tuple[int, str]]:
    """Run ``command`` as one job and wait for all of it.

    Args:
        command: ``argv`` of every process.
        ranks: ``None``: one process (it may start the other ranks itself, as Lightning's
            launcher does); ``n``: ``n`` processes with ``RANK = LOCAL_RANK = r`` and
            ``WORLD_SIZE = n``, as ``torchrun`` starts them.
        env: the environment (default: :func:`job_env`).
        cwd: the working directory (default: this one).
        timeout: seconds for the whole job, every process and every process it started.

    Returns:
        list[tuple[int, str]]: per started process, its exit code and its output (stdout and
        stderr together).

    Raises:
        JobTimeout: the job did not end within ``timeout`` seconds; every process group of the
            job is killed (SIGKILL) first.
    """
    env = job_env() if env is None else env
    per_rank = (
        [env]
        if ranks is None
        else [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks)) for r in range(ranks)]
    )
    return run_processes([(command, rank_env) for rank_env in per_rank], cwd=cwd, timeout=timeout)


def run_processes(
    processes: Sequence[tuple[Sequence[str], dict[str, str]]],
    *,
    cwd: str | Path | None = None,
    timeout: float = 240.0,
) -> list[tuple[int, str]]:
    """Run the processes of one job, each ``(argv, environment)`` (e.g. two ``torchrun`` nodes,
    or ranks with a cluster's variables), and wait for all of them, as :func:`run_job` does.

    Raises:
        JobTimeout: the job did not end within ``timeout`` seconds; every process group of the
            job is killed (SIGKILL) first.
    """
    procs = [
        subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command, env in processes
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, out))
        for p in procs:  # ranks started by Lightning's launcher live in the same process group
            while group_alive(p.pid):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(str(p.args), timeout)
                time.sleep(0.2)
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate()[0] for p in procs]
        raise JobTimeout(f"job exceeded its {timeout} s timeout; output:\n" + "\n".join(outs)) from None
    return results
