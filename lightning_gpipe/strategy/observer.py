"""The launching rank's watch over the ranks it started: a job whose rank died ends, but not before
the others have said why.

Lightning's launcher watches its children too (``_ChildProcessObserver``): within 5 s of a child's
non-zero exit it kills every process of the job, the launching one included, with SIGKILL. In a
pipeline that comes too soon: the survivors name the rank that died a few seconds after it did
(:mod:`lightning_gpipe.transport.liveness`), and after a signal every rank stops by itself, the
launching one writing ``OnExceptionCheckpoint``'s file after the others have exited.
:class:`ChildObserver` waits ``grace`` seconds after a child's non-zero exit before it ends what
is left, so it only ends a job that would otherwise hang (a rank still waiting in the rendezvous
for a child that died before it). It ends nothing while the launching process is outside a launch: a
script that caught the failed ``fit`` and goes on (a retry loop, a notebook) is left to go on, and its
next launch names the rank that is gone (:func:`lightning_gpipe.transport.rendezvous.watch`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["ChildObserver"]


class ChildObserver(threading.Thread):
    """Once a child in ``procs`` exits non-zero, wait ``grace`` seconds; if this process is still inside
    a launch then, say why and kill the children left and this process (SIGKILL, as Lightning does).

    Args:
        procs: the ranks this process started (local ranks 1, 2, ...).
        grace: seconds the job gets to end by itself after a child's failure.
        in_launch: whether this process runs a launch (``fit``, ``validate``, ...) at the moment;
            outside one nothing waits for the child, and nothing is ended.
        period: seconds between two looks at the children.
    """

    def __init__(
        self,
        procs: Sequence[subprocess.Popen],
        grace: float,
        in_launch: Callable[[], bool],
        period: float = 1.0,
    ) -> None:
        super().__init__(daemon=True, name="gpipe-child-observer")  # ends with the process
        self.procs, self.grace, self.in_launch, self.period = list(procs), grace, in_launch, period

    def run(self) -> None:
        while True:
            time.sleep(self.period)
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = [(i, proc) for i, proc in enumerate(self.procs, start=1) if proc.returncode]
            if failed:
                break
        time.sleep(self.grace)
        if not self.in_launch():
            return  # the failure reached this process, which went on: its next launch names the rank
        local_rank, proc = failed[0]
        print(
            f"[lightning_gpipe] local rank {local_rank} (pid {proc.pid}) exited with code {proc.returncode} "
            f"and the job was still running {self.grace:g} s later; ending it",
            file=sys.stderr,
            flush=True,
        )
        for other in self.procs:
            if other.poll() is None:
                other.kill()
        os.kill(os.getpid(), signal.SIGKILL)
