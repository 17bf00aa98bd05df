"""No collective reached by only some ranks waits for the process-group timeout.

User code can lead some ranks into an operation that needs every rank while the others go
elsewhere: a callback guarded by ``trainer.is_global_zero`` that saves a checkpoint, a condition
evaluated on one stage's data. Left alone, the ranks that arrived wait for ``torch.distributed``'s
timeout (30 minutes by default). :func:`arrive` runs before every such strategy operation: each rank
marks its arrival in the job's key-value store (the one ``torch.distributed`` was initialised
with) and waits for the others for at most ``timeout`` seconds; if some never come, it raises
:class:`CollectiveTimeout` naming the operation and the ranks missing, and leaves the same note in
the store, where the other ranks' failure reports (:mod:`lightning_gpipe.transport.failure`) find it. The
failure protocol then ends every rank. Cost: one store write and one wait per operation.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_gpipe.errors import CollectiveTimeout

NOTE_KEY = "gpipe/failure"
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

    Every rank of ``ranks`` must call it for the same operations in the same order.

    Raises:
        CollectiveTimeout: some ranks did not arrive in time; the message names them.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size()
    ranks = list(range(world)) if ranks is None else ranks
    if len(ranks) < 2:
        return
    _counts[operation] += 1
    key = f"gpipe/arrive/{operation}/{_counts[operation]}"
    store = _store()
    store.set(f"{key}/{dist.get_rank()}", "1")
    try:
        store.wait([f"{key}/{r}" for r in ranks], timedelta(seconds=timeout))
    except Exception as err:  # a timeout (DistStoreError) or a store that went away
        missing = [r for r in ranks if not _has(store, f"{key}/{r}")]
        if not missing:
            raise
        note = (
            f"{operation} needs every rank, but rank(s) {missing} did not reach it within {timeout:g} s "
            f"(rank {dist.get_rank()} did); call it on every rank (e.g. not only where "
            "trainer.is_global_zero), or raise GPipeStrategy(collective_timeout=...) if they are only slow"
        )
        try:
            store.set(NOTE_KEY, note)
        except Exception:  # noqa: BLE001, S110 - the note is a courtesy to the other ranks
            pass
        raise CollectiveTimeout(note) from err


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
