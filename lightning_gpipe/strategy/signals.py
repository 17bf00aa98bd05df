"""Signals: ``SIGTERM`` (and a first ``SIGINT``) stop every rank at the same step boundary, through
Lightning's exception path; a rank still running ``grace`` seconds later exits regardless.

During ``fit``'s training a signal is only recorded (:func:`record`); every rank's record is
reduced at each step boundary (:class:`SigtermCheck`, a max over the ranks, posted without
waiting), so a signal to the launching rank, to one rank or to the whole job (SLURM, Kubernetes)
stops every rank at the same step. There each raises Lightning's ``SIGTERMException``:
``on_exception`` callbacks run with every rank present (``OnExceptionCheckpoint`` writes its
checkpoint), loggers finalize, and the process exits with ``128 + signal``. A second ``SIGINT``
(Ctrl-C twice) raises ``KeyboardInterrupt`` at once. Outside training a signal ends the rank at once,
as before (``SystemExit``, ``KeyboardInterrupt``).

:func:`watch_signals` adds the forced exit: Python runs signal handlers only between bytecodes of
the main thread, which a rank blocked in a receive or a collective never reaches, so a thread wakes
on the signal (``signal.set_wakeup_fd``), passes it on to the ranks this one started, and ends the
process ``grace`` seconds later (``GPipeStrategy(signal_grace=...)``) if it is still running.
"""

from __future__ import annotations

import functools
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

from lightning_gpipe import _lightning
from lightning_gpipe.transport import failure
from lightning_gpipe.transport.layout import Layout

__all__ = [
    "SIGNAL_GRACE_S",
    "SigtermCheck",
    "check_grace",
    "defer_sigterm_check",
    "end_rank",
    "forward_signal",
    "record",
    "requested",
    "restore_sigterm_check",
    "watch",
    "watch_signals",
]

SIGNAL_GRACE_S = 30.0
"""Default seconds a rank may still run after SIGTERM/SIGINT before it exits regardless (SLURM's
default ``KillWait`` between its SIGTERM and its SIGKILL is 30 s)."""

_watch: dict[str, Any] = {}  # the watching thread's pipe, grace and forwarding (one per process)
_stop: dict[str, Any] = {"requested": 0, "armed": False}  # the signal recorded; training under way


def check_grace(grace: float) -> float:
    """``signal_grace`` as a float (seconds).

    Raises:
        ValueError: it is not a number > 0.
    """
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
        raise ValueError(f"signal_grace must be a number of seconds > 0 (signal_grace: {grace!r})")
    return float(grace)


def requested() -> int:
    """The signal recorded on this rank during training (``SIGTERM``, ``SIGINT``), or 0."""
    return int(_stop["requested"])


def record(signum: int, frame: Any = None) -> None:
    """During training, record ``signum`` for the next step boundary (in place of Lightning's SIGTERM
    notifier, which would run a collective of this rank alone from the signal handler); otherwise
    nothing (the handler :func:`watch_signals` installs ends the rank)."""
    if not _stop["armed"]:
        return
    if not _stop["requested"]:
        _stop["requested"] = int(signum)  # said by the watching thread (a print here could re-enter one)
    elif signum == signal.SIGINT and _stop["requested"] == signal.SIGINT:
        raise KeyboardInterrupt


def _on_signal(signum: int, frame: Any) -> None:
    """The handler :func:`watch_signals` installs: recorded during training, otherwise the rank ends now."""
    if _stop["armed"]:
        record(signum, frame)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        raise SystemExit(128 + signum)


def watch_signals(grace: float, on_signal: Callable[[int], None] | None = None) -> None:
    """End this process ``grace`` seconds after ``SIGTERM`` or ``SIGINT`` if it is still running.

    Installs the handler of both signals where none is set (Python's own ``KeyboardInterrupt`` for
    ``SIGINT`` counts as none): recorded during training (:func:`record`), otherwise ``SystemExit`` /
    ``KeyboardInterrupt`` at once. A thread wakes on the signal (``signal.set_wakeup_fd``, which works
    while the main thread is blocked in C++), calls ``on_signal(signum)`` (e.g. forward it to child
    ranks), and if the process has not ended ``grace`` seconds later, prints why and exits with
    ``128 + signum``; its peers then see the connection close and end through the failure protocol.
    Call from the main thread; a later call sets a new ``grace`` and ``on_signal``. Does nothing when
    another wakeup fd is already set (e.g. by asyncio).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if _watch:
        _watch.update(grace=grace, on_signal=on_signal)
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
    for sig in (signal.SIGTERM, signal.SIGINT):  # the wakeup fd is written only for signals with a handler
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler, None):
            signal.signal(sig, _on_signal)
    _watch.update(grace=grace, on_signal=on_signal, read_fd=read_fd, write_fd=write_fd)
    thread = threading.Thread(target=_watch_thread, args=(read_fd,), name="gpipe-signals", daemon=True)
    thread.start()
    _watch["thread"] = thread


def _watch_thread(read_fd: int) -> None:
    while True:
        data = os.read(read_fd, 1)
        if not data:
            return
        signum = data[0]
        if signum not in (signal.SIGTERM, signal.SIGINT):
            continue
        on_signal, grace = _watch.get("on_signal"), float(_watch.get("grace", SIGNAL_GRACE_S))
        if on_signal is not None:
            try:
                on_signal(signum)
            except Exception:  # noqa: BLE001, S110 - best effort while shutting down
                pass
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        if _stop["armed"]:
            print(
                f"[lightning_gpipe] rank {rank} got {signal.Signals(signum).name}: every rank stops at the "
                "next step boundary, where on_exception callbacks (e.g. OnExceptionCheckpoint) run"
                + ("; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""),
                file=sys.stderr,
                flush=True,
            )
        threading.Event().wait(grace)
        print(
            f"[lightning_gpipe] rank {rank} got "
            f"{signal.Signals(signum).name} and was still running {grace:g} s later (blocked in a "
            "receive or a collective, or the step, validation or checkpoint took longer: raise "
            "GPipeStrategy(signal_grace=...)); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)


def watch(launcher: Any, grace: float) -> None:
    """:func:`watch_signals` with ``grace`` seconds, passing SIGTERM on to the ranks ``launcher`` started."""
    watch_signals(grace, on_signal=functools.partial(forward_signal, launcher))


def forward_signal(launcher: Any, signum: int) -> None:
    """On SIGTERM, the launching rank passes the signal on to the ranks its ``launcher`` started.

    ``SIGINT`` is not passed on: Ctrl-C reaches every process of the terminal's job already, and a
    second one would stop the ranks at once; during training the stop spreads through
    :class:`SigtermCheck`, otherwise the launching rank's exit ends the others."""
    kill = getattr(launcher, "kill", None)
    if signum == signal.SIGTERM and callable(kill):
        kill(signum)


class SigtermCheck:
    """The per-step stop check, agreed over every rank and without a wait: the signals recorded by
    step ``k`` stop every rank at step ``k + 1``.

    Lightning starts every training step with a blocking broadcast of rank 0's
    ``trainer.received_sigterm`` (``_TrainingEpochLoop._broadcast_sigterm_tensor``). In a pipeline
    that collective joins the stages at every step boundary (the first stage, which starts the next
    step, waits a round trip for the last one), and only rank 0's signal counts. Called in its place,
    this posts a max over every rank's recorded signal (:func:`requested`) without waiting and reads
    the previous step's, which has long arrived: a signal to any rank stops every rank at the same
    step, one step later than under Lightning's check.

    Args:
        device: where the flag lives (the strategy's root device: NCCL reduces CUDA tensors).
        exception: what to raise, with the exit code ``128 + signal`` (Lightning's ``SIGTERMException``).
        flag: this rank's recorded signal, or 0 (default: :func:`requested`).

    Attributes:
        stopped_by: the signal every rank stopped on (0 while none).
    """

    def __init__(
        self,
        device: torch.device,
        exception: Callable[[int], BaseException],
        flag: Callable[[], int] = requested,
    ) -> None:
        self.device, self.exception, self.flag = device, exception, flag
        self._pending: tuple[Any, torch.Tensor] | None = None  # the last step's reduction and its flag
        self.stopped_by = 0

    def __call__(self) -> None:
        """Act on the previous step's flag (raise ``exception`` on every rank), then post this step's."""
        if self._pending is not None:
            (work, flag), self._pending = self._pending, None
            work.wait()
            signum = int(flag.item())
            if signum:
                self.stopped_by = signum
                with suppress(Exception):
                    dist.barrier()  # as Lightning: every rank is here, none is left in a collective
                raise self.exception(128 + signum)
        flag = torch.tensor([self.flag()], dtype=torch.int64, device=self.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def close(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the last reduction posted, so that no collective is
        left in flight when the process group goes; a rank that never posted it is not waited for longer."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with suppress(Exception):
                pending[0].wait(timedelta(seconds=timeout))


def defer_sigterm_check(trainer: Any, device: torch.device) -> SigtermCheck:
    """Take over the trainer's SIGTERM handling: Lightning's notifier records only (:func:`record`) and,
    under ``fit``, a :class:`SigtermCheck` stands in for the per-step broadcast and signals are recorded
    (armed) until :func:`restore_sigterm_check`."""
    check = SigtermCheck(device, _lightning.sigterm_exception(trainer))
    _lightning.set_sigterm_notifier(trainer, record)
    if getattr(trainer.state.fn, "value", None) == "fit":
        _lightning.set_sigterm_check(trainer, check)
        _stop.update(requested=0, armed=True)
    return check


def restore_sigterm_check(trainer: Any, check: SigtermCheck | None, failed: bool, timeout: float) -> None:
    """Give ``trainer`` (if any) Lightning's own SIGTERM handling back, stop recording signals and,
    unless the run ``failed``, close ``check`` (if any) within ``timeout`` seconds."""
    if trainer is not None:
        _lightning.set_sigterm_check(trainer, None)
        _lightning.set_sigterm_notifier(trainer, None)
    _stop["armed"] = False
    if check is not None and not failed:
        check.close(timeout)


def end_rank(exception: BaseException, check: SigtermCheck | None, layout: Layout, rank: int) -> None:
    """After ``exception`` on ``rank``: a stop agreed by :class:`SigtermCheck` ends quietly (every rank
    is at the same boundary; their process group stays for the exit), anything else goes through the
    failure protocol (:func:`lightning_gpipe.transport.failure.report_and_abort`)."""
    where = f"stage {layout.stage_of(rank)} (rank {rank})"
    if check is not None and check.stopped_by:
        name = signal.Signals(check.stopped_by).name
        print(f"[lightning_gpipe] {where} stopped on {name} with every rank", file=sys.stderr, flush=True)
    elif _lightning.distributed_is_initialized():
        failure.report_and_abort(exception, where)
