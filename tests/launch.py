"""The tests' job launcher: torchrun-style ranks forked from a fork server (:class:`Zygote`).

A job is run by :mod:`lightning_gpipe.tools.launch` (every process in a process group of its own,
killed whole on timeout); a ``python script ...`` job's processes (each torchrun-style rank, or the
one process that launches the others) come instead forked from a process that has imported torch
and Lightning (``tests/workers/zygote.py``), which saves each of them the imports.
``GPIPE_TEST_FRESH=1`` starts every rank as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_gpipe.tools import launch
from lightning_gpipe.tools.launch import JobTimeout, group_alive, job_env, run_processes

__all__ = ["JobTimeout", "Zygote", "job_env", "run_job", "run_processes"]


def run_job(
    command: Sequence[str],
    *,
    ranks: int | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 240.0,
) -> list[tuple[int, str]]:
    """:func:`lightning_gpipe.tools.launch.run_job`, its processes forked from the :class:`Zygote`
    where the command is ``python script.py ...``: the torchrun-style ranks (``ranks=n``), or the
    one launching process (``ranks=None``), whose other ranks Lightning's launcher starts as fresh
    interpreters."""
    if not Zygote.usable(command):
        return launch.run_job(command, ranks=ranks, env=env, cwd=cwd, timeout=timeout)
    env = job_env() if env is None else env
    if ranks is None:
        return Zygote.get().run([(command, env)], cwd=cwd, timeout=timeout)
    per_rank = [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks)) for r in range(ranks)]
    return Zygote.get().run([(command, rank_env) for rank_env in per_rank], cwd=cwd, timeout=timeout)


class Zygote:
    """The session's fork server (tests/workers/zygote.py): torchrun-style ranks of ``python
    script ...`` start forked from a process that has imported torch and Lightning, instead of as
    fresh interpreters that each import them (some 6 s of CPU per rank on 2 cores).

    ``GPIPE_TEST_FRESH=1`` turns it off (every rank a fresh interpreter). A job started once
    (:func:`run_job` with ``ranks=None``) has its launching process forked from here, and the ranks
    that Lightning's launcher starts from it are fresh interpreters, as for a user: that launcher's
    own path is what such jobs test. Like :func:`run_processes`, each process leads a process group
    of its own (with the ranks it starts), killed whole on timeout.
    """

    _instance: Zygote | None = None

    @staticmethod
    def usable(command: Sequence[str]) -> bool:
        return (
            os.environ.get("GPIPE_TEST_FRESH") != "1"
            and len(command) >= 2
            and command[0] == sys.executable
            and str(command[1]).endswith(".py")
        )

    @classmethod
    def get(cls) -> Zygote:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        env = job_env(threads=1)
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        self.logs = Path(tempfile.mkdtemp(prefix="gpipe-zygote-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.zygote"],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.jobs = 0
        atexit.register(self.close)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.logs, ignore_errors=True)

    def _line(self, deadline: float) -> dict | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError("the tests' fork server (tests/workers/zygote.py) ended")
                return json.loads(line)

    def run(
        self,
        processes: Sequence[tuple[Sequence[str], dict[str, str]]],
        *,
        cwd: str | Path | None = None,
        timeout: float = 240.0,
    ) -> list[tuple[int, str]]:
        self.jobs += 1
        logs = [self.logs / f"job{self.jobs}_proc{k}.log" for k in range(len(processes))]
        request = {
            "processes": [
                {"argv": list(command), "env": env, "cwd": str(cwd or os.getcwd()), "log": str(log)}
                for (command, env), log in zip(processes, logs)
            ]
        }
        deadline = time.monotonic() + timeout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pids = self._line(time.monotonic() + 60)
        if pids is None:
            raise RuntimeError("the tests' fork server did not start the job within 60 s")
        pids = pids["pids"]
        done = self._line(deadline)
        if done is not None:  # ranks' own children (none expected) may still be ending
            for pid in pids:
                while group_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.2)
        if done is None or any(group_alive(pid) for pid in pids):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            if done is None:
                self._line(time.monotonic() + 30)  # the server reaps them
            outs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
            raise JobTimeout(f"job exceeded its {timeout} s timeout; output:\n" + "\n".join(outs))
        outs = [log.read_text(errors="replace") for log in logs]
        for log in logs:
            log.unlink()
        return list(zip(done["rcs"], outs))
