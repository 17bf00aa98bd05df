"""Signals: ``SIGTERM`` and ``SIGINT`` end a rank within seconds; Lightning's SIGTERM check waits for no one.

:func:`watch_signals` makes ``SIGTERM`` and ``SIGINT`` end a rank within seconds even while its
main thread is blocked in a receive or a collective (Python runs signal handlers only between
bytecodes of the main thread, which a blocked wait never reaches). :class:`SigtermCheck` takes
the place of Lightning's per-step SIGTERM broadcast, which would join the stages at every step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SIGNAL_GRACE_S", "SigtermCheck", "watch_signals"]

SIGNAL_GRACE_S = 3.0
"""After SIGTERM/SIGINT, how long a rank may still run before it exits regardless, seconds."""

_watch: dict[str, Any] = {}


def watch_signals(grace: float, on_signal: Callable[[int], None] | None = None) -> None:
    """End this process ``grace`` seconds after ``SIGTERM`` or ``SIGINT`` if it is still running.

    A thread wakes on the signal (``signal.set_wakeup_fd``, which works while the main thread is
    blocked in C++), calls ``on_signal(signum)`` (e.g. forward it to child ranks), and if the
    process has not ended after ``grace`` seconds (Lightning's own handling, a
    ``KeyboardInterrupt``), prints why and exits with ``128 + signum``. Its peers then see the
    connection close and end through the failure protocol. Call from the main thread; a no-op when
    another wakeup fd is already set (e.g. by asyncio) or the signals are ignored.
    """
    if _watch or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:  # someone else listens there: leave it to them
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    for sig in (
        signal.SIGTERM,
        signal.SIGINT,
    ):  # the wakeup fd is written only for signals with a Python handler
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else _raise_system_exit)

    def run() -> None:
        while True:
            data = os.read(read_fd, 1)
            if not data:
                return
            signum = data[0]
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            if on_signal is not None:
                try:
                    on_signal(signum)
                except Exception:  # noqa: BLE001, S110 - best effort while shutting down
                    pass
            threading.Event().wait(grace)
            print(
                f"[lightning_gpipe] rank {os.environ.get('RANK', os.environ.get('LOCAL_RANK', '0'))} got "
                f"{signal.Signals(signum).name} and was still running {grace:g} s later (blocked in a "
                "receive or a collective); exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)

    thread = threading.Thread(target=run, name="gpipe-signals", daemon=True)
    thread.start()
    _watch.update(thread=thread, read_fd=read_fd, write_fd=write_fd)


class SigtermCheck:
    """Lightning's per-step SIGTERM check with no wait: rank 0's flag of step ``k`` is acted on at
    step ``k + 1``.

    Lightning starts every training step with a blocking broadcast of rank 0's
    ``trainer.received_sigterm`` to every rank (``_TrainingEpochLoop._broadcast_sigterm_tensor``),
    so that all ranks stop at the same step. In a pipeline that collective joins the stages at
    every step boundary: the first stage, which starts the next step, waits a round trip for the
    last one, a round trip on the critical path of every step. Called in its place,
    this posts the step's broadcast without waiting and reads the previous step's, which has long
    arrived: every rank still stops at the same step, one step later than under Lightning's check.

    Args:
        trainer: the Trainer (its ``received_sigterm``).
        device: where the flag lives (the strategy's root device: NCCL broadcasts CUDA tensors).
        exception: what to raise on a SIGTERM, after a barrier as Lightning does (its ``SIGTERMException``).
    """

    def __init__(self, trainer: Any, device: torch.device, exception: type[BaseException]) -> None:
        self.trainer, self.device, self.exception = trainer, device, exception
        self._pending: tuple[Any, torch.Tensor] | None = None  # the last step's broadcast and its flag

    def __call__(self) -> None:
        """Act on the previous step's flag (raise ``exception`` on every rank), then post this step's."""
        if self._pending is not None:
            (work, flag), self._pending = self._pending, None
            work.wait()
            if flag.item() == 1:
                with suppress(Exception):
                    dist.barrier()  # as Lightning: every rank is here, none is left in a collective
                raise self.exception()
        flag = torch.tensor(
            [1 if getattr(self.trainer, "received_sigterm", False) else 0], device=self.device
        )
        self._pending = (dist.broadcast(flag, src=0, async_op=True), flag)

    def close(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the last broadcast posted, so that no collective is
        left in flight when the process group goes; a rank that never posted it is not waited for longer."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with suppress(Exception):
                pending[0].wait(timedelta(seconds=timeout))


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
