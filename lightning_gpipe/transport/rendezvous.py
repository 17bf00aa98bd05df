"""A job's later ``fit``, ``validate``, ``test`` and ``predict`` calls start clean, after a failure too.

The first entry call of a job connects the ranks through the environment (Lightning's rendezvous on
``MASTER_ADDR:MASTER_PORT``); :func:`join` then keeps the job's key-value store for the life of the
process. At each later entry call of the same ranks every rank first waits until all have arrived
(:func:`gather`), saying whether its connection is intact. When all are, the connection is kept, as
under DDP. When one is not (issue 40: a failure that was caught, a retry loop, a notebook cell, a
tuner trial; the failure protocol destroyed the group on the ranks that failed, and perhaps not on
the others), every rank tears its connection down and :func:`reconnect` makes a new default process
group over the same store under a new prefix, ``gpipe/<n>``, so that nothing of the last connection
is read again: its rendezvous keys, arrival counts, failure note and heartbeat records. A second
``init_process_group`` on the old keys reads a peer's stale address and fails with ``Connection
refused`` or waits forever (pytorch/pytorch#74666).

The ranks count their entry calls alike because every rank makes the same calls, which the
strategy requires anyway. A rank that will never arrive is named at once: one the launching process
started that has exited (:func:`watch`), or one whose heartbeat stopped
(:mod:`lightning_gpipe.transport.liveness`).
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_gpipe.transport import liveness

__all__ = [
    "RendezvousError",
    "check_started",
    "gather",
    "generation",
    "join",
    "joined",
    "leave",
    "reconnect",
    "watch",
]

_job: dict[str, Any] = {}  # store, generation, excepthook, ended (the launching process' check)


class RendezvousError(RuntimeError):
    """The job's ranks cannot be connected again: one of them has ended."""


def joined() -> bool:
    """Whether this process holds a job's store: the next entry call connects through :func:`reconnect`."""
    return "store" in _job


def generation() -> int:
    """How many times this job's ranks connected afresh after the first connection (0 outside a job)."""
    return int(_job.get("generation", 0))


def join(excepthook: Any) -> None:
    """Keep the store of the default process group just initialized as the job's (once per job);
    ``excepthook`` is ``sys.excepthook`` as it was before that initialization (each
    ``init_process_group`` wraps it in a ``[rank R]`` prefix). The store is let go at exit (its
    server's thread ends with it, before Python shuts down)."""
    if not joined() and dist.is_available() and dist.is_initialized():
        _job.update(store=_get_default_store(), generation=0, excepthook=excepthook)
        atexit.register(leave)


def watch(ended: Callable[[], str | None]) -> None:
    """In the launching process: ``ended()`` says which ranks it started have exited (``None``: none)."""
    _job["ended"] = ended


def check_started(what: str = "this fit, validate, test or predict call") -> None:
    """In the launching process, before the job's first connection: fail at once if a rank it
    started has exited already (the launch failed before its rendezvous).

    Raises:
        RendezvousError: naming the ranks that exited.
    """
    ended = _job["ended"]() if "ended" in _job else None
    if ended is not None:
        raise _error(what, ended)


def leave() -> None:
    """Forget the job (the launcher's ``release``): the next entry call connects through the environment."""
    _job.clear()


def gather(
    rank: int,
    world_size: int,
    timeout: timedelta,
    intact: bool,
    what: str = "this fit, validate, test or predict call",
) -> bool:
    """Wait until every rank has reached the job's next entry call, within ``timeout``; whether every
    rank's connection is ``intact`` (its default process group still initialized).

    Each rank marks its arrival under ``gpipe/connect/<k>`` (its ``k``-th entry call after the
    first) in the job's store, with its ``intact``. A rank still missing that the launching process
    started and that has exited, or whose heartbeat stopped for
    :data:`~lightning_gpipe.transport.liveness.SILENCE_S` seconds (it exited or died), will never
    come: the wait ends at once.

    Raises:
        RendezvousError: a rank has ended, or not every rank arrived within ``timeout``; the message
            names the ranks and says that this process cannot train with them again.
    """
    _job["connects"] = _job.get("connects", 0) + 1
    store, key = _job["store"], f"gpipe/connect/{_job['connects']}"
    try:
        store.set(f"{key}/{rank}", "1" if intact else "0")
        ended = _wait(store, key, rank, world_size, timeout.total_seconds())
        if ended is None:
            return all(store.get(f"{key}/{r}") == b"1" for r in range(world_size))
    except Exception as err:  # noqa: BLE001 - the store is gone with the process holding it
        ended = f"the job's store ({liveness.store_holder()}) cannot be reached ({err})"
    raise _error(what, ended)


def _error(what: str, ended: str) -> RendezvousError:
    return RendezvousError(
        f"{what} needs every rank of the job, but {ended}; this process cannot train with them "
        "again: catch the exception on every rank (each rank makes the same fit, validate, test "
        "and predict calls), or start the next run in a new process"
    )


def _wait(store: Any, key: str, rank: int, world_size: int, timeout: float) -> str | None:
    """Wait for every rank's mark under ``key``; ``None`` once all are there, else why they never will be."""
    others = [r for r in range(world_size) if r != rank]
    keys = [f"{key}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout
    before, since, delay = _counts(others), time.monotonic(), 0.0005
    while True:
        ended = _job["ended"]() if "ended" in _job else None
        if ended is not None:  # checked after all arrived too: a started rank may have been ended since
            return str(ended)
        if store.check(keys):
            return None
        if before is not None and time.monotonic() - since >= liveness.SILENCE_S:
            after = _counts(others) or {}
            silent = [r for r in _missing(store, key, others) if after.get(r) == before.get(r)]
            if silent:
                names = ", ".join(liveness.describe(r) for r in silent)
                return (
                    f"{names} stopped beating (no heartbeat for {liveness.SILENCE_S:g} s): it exited or died"
                )
            before, since = after, time.monotonic()
        if time.monotonic() >= deadline:
            return f"rank(s) {_missing(store, key, others)} did not reach it within {timeout:g} s"
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _missing(store: Any, key: str, ranks: list[int]) -> list[int]:
    return [r for r in ranks if not store.check([f"{key}/{r}"])]


def _counts(ranks: list[int]) -> dict[int, int] | None:
    """Each rank's heartbeat count, whether it left or not (``None``: no heartbeat to read)."""
    try:
        return liveness.beats(ranks, count_left=True)
    except liveness.StoreLost:
        return None


def reconnect(backend: str, rank: int, world_size: int, **kwargs: Any) -> None:
    """Initialize the default process group again over the job's store, under the next prefix
    ``gpipe/<n>`` (after :func:`gather`, with the last group destroyed); ``kwargs`` go to
    ``init_process_group`` (``timeout``, ``device_id``)."""
    n = generation() + 1
    sys.excepthook = _job["excepthook"]  # one "[rank R]" prefix, not one per connection
    store = dist.PrefixStore(f"gpipe/{n}", _job["store"])
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, **kwargs)
    _job["generation"] = n
