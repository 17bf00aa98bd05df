"""No collective reached by only some ranks waits for the process-group timeout.

User code can lead some ranks into an operation that needs every rank while the others go
elsewhere: a callback guarded by ``trainer.is_global_zero`` that saves a checkpoint, a condition
evaluated on one stage's data. Left alone, the ranks that arrived wait for ``torch.distributed``'s
timeout (30 minutes by default). :func:`arrive` runs before every such strategy operation: each rank
marks its arrival in the job's key-value store (the one ``torch.distributed`` was initialised
with) and waits for the others for at most ``timeout`` seconds; if some never come, it raises
:class:`CollectiveTimeout` naming the operation and the ranks missing, and leaves the same note in
the store, where the other ranks' failure reports (:mod:`lightning_gpipe.transport.failure`) find it. The
failure protocol then ends every rank. A missing rank that failed with an error of its own (in any
hook, callback or dataloader: it left, saying why, :func:`~lightning_gpipe.transport.liveness.leave`)
is named with its error within :data:`DEPARTURE_S` seconds, with :class:`RankFailed`; one that is gone
(killed, its connection lost: :mod:`lightning_gpipe.transport.liveness`) within seconds, with
:class:`RankLost`. Cost: one store write and one wait per operation (and, while waiting, a look for
departures every :data:`DEPARTURE_S` seconds and a heartbeat check every few seconds).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_gpipe.errors import CollectiveTimeout, RankFailed, RankLost
from lightning_gpipe.transport import liveness

NOTE_KEY = "gpipe/failure"
DEPARTURE_S = 0.2
"""Seconds between two looks, while waiting, for a missing rank that left (failed, or exited)."""
_counts: Counter[str] = Counter()


def reset() -> None:
    """Number operations from the start again: called on every rank when a job connects its ranks.

    A process that runs several jobs (rank 0 of a Hydra sweep) meets fresh child ranks each time;
    counts left from the last job would name keys the new ranks never write.
    """
    _counts.clear()


def _store() -> Any:
    return _get_default_store()


def arrive(operation: str, timeout: float, ranks: list[int] | None = None) -> None:
    """Wait (at most ``timeout`` seconds) until every rank of ``ranks`` (default: all) reaches ``operation``.

    Every rank of ``ranks`` must call it for the same operations in the same order; operations are
    numbered per rank set, so that fits of other layouts in the same processes keep the numbers agreeing
    (a K=2 × D=2 fit, then a K=2 × T=2 one, pair rank 0 with rank 1, then with rank 2). Every
    :data:`~lightning_gpipe.transport.liveness.SILENCE_S` seconds of waiting, a rank still missing
    that has stopped beating (:mod:`lightning_gpipe.transport.liveness`) is named at
    once, rather than the user's code blamed at the timeout; one that left (it failed with an error of
    its own, or exited) within :data:`DEPARTURE_S` seconds.

    Raises:
        RankFailed: a rank still missing failed with an error of its own; the message names it and the error.
        RankLost: a rank still missing died or lost its connection; the message names it.
        CollectiveTimeout: some ranks did not arrive in time; the message names them.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    world, me = dist.get_world_size(), dist.get_rank()
    # numbered per rank set: a process whose fits place it in other subsets (one pipeline of a K × D × T
    # mesh, then another layout's) keeps the count its peers of this set keep
    counted = operation if ranks is None else f"{operation} [{','.join(map(str, sorted(ranks)))}]"
    ranks = list(range(world)) if ranks is None else ranks
    if len(ranks) < 2:
        return
    _counts[counted] += 1
    key = f"gpipe/arrive/{counted}/{_counts[counted]}"
    store = _store()
    others = [r for r in ranks if r != me]
    known = liveness.known_lost(others)  # a rank found gone before: no wait
    if known is not None:
        _fail(RankLost(f"{operation} needs every rank, but {known} (rank {me} waited for it)"), None)
    store.set(f"{key}/{me}", "1")
    keys, deadline = [f"{key}/{r}" for r in ranks], time.monotonic() + timeout
    before, since, delay = _beats(others), time.monotonic(), 0.0005
    look = time.monotonic() + DEPARTURE_S
    while True:  # polled (store.wait logs a warning at each timeout): every 50 ms at most
        error: Exception | None = None
        try:
            if store.check(keys):
                return
        except Exception as err:  # noqa: BLE001 - the store went away: said below
            error = err
        now = time.monotonic()
        if now >= look and error is None:
            _fail_if_departed(operation, me, [r for r in others if not _has(store, f"{key}/{r}")])
            look = now + DEPARTURE_S
        if before is not None and (error is not None or now - since >= liveness.SILENCE_S):
            missing = [r for r in others if not _has(store, f"{key}/{r}")]
            cause = liveness.lost(missing, before) if missing else None
            if cause is not None:
                _fail(RankLost(f"{operation} needs every rank, but {cause} (rank {me} waited for it)"), error)
            before, since = _beats(others), time.monotonic()
        if now >= deadline or (error is not None and before is None):
            missing = [r for r in ranks if not _has(store, f"{key}/{r}")]
            note = (
                f"{operation} needs every rank, but rank(s) {missing} did not reach it within "
                f"{timeout:g} s (rank {me} did); call it on every rank (e.g. not only where "
                "trainer.is_global_zero), or raise GPipeStrategy(collective_timeout=...) if they are "
                "only slow"
            )
            _fail(CollectiveTimeout(note), error)
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _fail_if_departed(operation: str, me: int, missing: list[int]) -> None:
    """Raise :class:`RankFailed` when a rank of ``missing`` left (failed, or exited) while ``me`` waited
    at ``operation``: it will never come."""
    left = liveness.departed(missing)
    if left:
        said = "; ".join(reason for _, reason in sorted(left.items()))
        _fail(
            RankFailed(
                f"{operation} needs every rank, but {said} (rank {me} waited for it; that rank's "
                "traceback is printed, tagged [lightning_gpipe], in its output)"
            ),
            None,
        )


def _beats(ranks: list[int]) -> dict[int, int] | None:
    try:
        return liveness.beats(ranks)
    except liveness.StoreLost:
        return {}  # compared after the next slice: the store's loss is named then


def _fail(error: Exception, cause: BaseException | None) -> NoReturn:
    """Leave ``error``'s message where the other ranks' failure reports find it, and raise it."""
    try:
        _store().set(NOTE_KEY, str(error))
    except Exception:  # noqa: BLE001, S110 - the note is a courtesy to the other ranks
        pass
    raise error from cause


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def failure_note() -> str | None:
    """The note a rank left when an operation timed out (``None`` if none, or the store is gone)."""
    try:
        store = _store()
        if store.check([NOTE_KEY]):
            return str(store.get(NOTE_KEY).decode())
    except Exception:  # noqa: BLE001
        return None
    return None


def check_collective_timeout(collective_timeout: float) -> float:
    """``collective_timeout`` as a float.

    Raises:
        ValueError: it is not > 0 seconds.
    """
    if not collective_timeout > 0:
        raise ValueError(
            f"collective_timeout must be > 0 seconds (collective_timeout: {collective_timeout!r})"
        )
    return float(collective_timeout)
