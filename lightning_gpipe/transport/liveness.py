"""Which ranks are alive: a heartbeat per rank in the job's store, read when a peer goes quiet.

A rank killed with SIGKILL (the OOM killer, a lost node) prints nothing; its peers see only a
connection closed, or nobody arriving at a collective. So that every survivor can name it, each rank
beats while it runs: a thread adds 1 to the key ``gpipe/beat/<rank>`` of the job's key-value store
(the one ``torch.distributed`` was initialised with, over a connection of its own) every
:data:`BEAT_S` seconds. A rank that leaves on purpose (a failure it reports, the end of the job)
says so first (:func:`leave`). :func:`gone` then tells, within :data:`SILENCE_S` seconds, which
ranks stopped beating without leaving: they died or lost their connection. When the store itself
cannot be reached, the rank whose process holds it is gone (rank 0 under Lightning's launcher,
``torchrun`` without its agent, ``srun``).

The rank whose process holds the store waits at exit, up to :data:`LINGER_S` seconds, for the others to
leave, so that their last reads of it (who is gone, a failure's note) still find it.

Cost: one store write per rank every :data:`BEAT_S` seconds, in a thread.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_gpipe.transport.layout import Layout

__all__ = [
    "BEAT_S",
    "LINGER_S",
    "SILENCE_S",
    "StoreLost",
    "beats",
    "departed",
    "describe",
    "gone",
    "known_lost",
    "leave",
    "lost",
    "start",
    "stop",
    "store_holder",
    "store_rank",
]

BEAT_S = 0.5
"""Seconds between two heartbeats of a rank."""
SILENCE_S = 2.5
"""Seconds without a heartbeat after which a rank that did not leave counts as gone."""
LINGER_S = 6.0
"""Seconds the rank holding the store waits at exit for the others to leave (their last reads need it)."""

_KEY = "gpipe/beat/"
_LEFT = "gpipe/left/"
_state: dict[str, Any] = {}  # thread, stop event, rank, reader (the main thread's store connection), left
_EXIT_HOOK: list[bool] = []
_names: dict[str, Layout | None] = {}  # the job's layout, for messages


class StoreLost(RuntimeError):
    """The job's store cannot be reached: the process that holds it is gone."""


def _connection() -> Any:
    """A new connection to the job's store (the default process group's), or ``None`` where there is
    none to make (a store in this process only)."""
    store = _get_default_store()
    try:
        return store.clone()  # type: ignore[attr-defined]  # not in torch's stubs
    except Exception:  # noqa: BLE001, S110 - no clone: a client of the TCP store underneath, if any
        pass
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=5))
    return None


def start(rank: int, layout: Layout | None = None) -> None:
    """Start this rank's heartbeat (after the default process group is initialised; a later call,
    the next job's, stops the last one first); ``layout`` names the ranks' stages in messages."""
    stop()
    _names["layout"] = layout
    beat, reader = _connection(), _connection()
    if beat is None or reader is None:
        return
    for store in (beat, reader):
        store.set_timeout(timedelta(seconds=5))
    done = threading.Event()
    beat.add(f"{_KEY}{rank}", 1)

    def run() -> None:
        while not done.wait(BEAT_S):
            try:
                beat.add(f"{_KEY}{rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to beat for
                return

    thread = threading.Thread(target=run, name="gpipe-heartbeat", daemon=True)
    thread.start()
    # the store itself is kept: on rank 0 it holds the server, which must outlive a failure's abort of
    # the process group while the other ranks still read who is gone
    world = dist.get_world_size() if dist.is_initialized() else 1
    _state.update(thread=thread, done=done, rank=rank, world=world, reader=reader, beat=beat)
    _state["store"] = _get_default_store()
    if not _EXIT_HOOK:
        atexit.register(stop)  # joined while Python still runs: no thread in the store at finalization
        _EXIT_HOOK.append(True)


def stop(reason: str | None = "exited") -> None:
    """Stop this rank's heartbeat, having said why it leaves (``None``: say nothing)."""
    if "thread" not in _state:
        _state.clear()
        return
    if reason is not None:
        leave(reason)
    if _state["rank"] == store_rank():
        _await_others(LINGER_S)
    _state["done"].set()
    _state["thread"].join(timeout=2 * BEAT_S + 5)
    _state.clear()


def leave(reason: str) -> None:
    """Tell the other ranks that this one leaves on purpose (``reason``), so that they do not count it
    as gone once it stops beating; the first reason stands (a failure's is not overwritten by the
    ``"exited"`` said at exit, which a rank that learns of the failure later would read instead)."""
    reader = _state.get("reader")
    if reader is not None and "left" not in _state:
        _state["left"] = reason
        try:
            reader.set(f"{_LEFT}{_state['rank']}", reason)
        except Exception:  # noqa: BLE001, S110 - the store is gone; the others learn it themselves
            pass


def departed(ranks: list[int]) -> dict[int, str]:
    """The ranks of ``ranks`` that left on purpose (:func:`leave`), with the reason each gave (e.g.
    ``"stage 0 (rank 1) failed: ValueError: ..."``); empty when none did, this rank has no heartbeat or
    the store cannot be reached (said by :func:`lost`)."""
    reader = _state.get("reader")
    if reader is None or not ranks:
        return {}
    try:
        left = [r for r in ranks if reader.check([f"{_LEFT}{r}"])]
        return {r: reader.get(f"{_LEFT}{r}").decode(errors="replace") for r in left}
    except Exception:  # noqa: BLE001 - the store is gone: lost() says so
        return {}


def beats(ranks: list[int], count_left: bool = False) -> dict[int, int] | None:
    """Each rank's heartbeat count now (a rank that left: -1, unless ``count_left``: a rank that left
    after a failure beats on until it exits); ``None`` when this rank has no heartbeat.

    Raises:
        StoreLost: the store cannot be reached.
    """
    reader = _state.get("reader")
    if reader is None:
        return None
    try:
        counts = {}
        for r in ranks:
            left = not count_left and reader.check([f"{_LEFT}{r}"])
            counts[r] = -1 if left else int(reader.add(f"{_KEY}{r}", 0))
    except Exception as err:
        raise StoreLost(f"the job's store ({store_holder()}) cannot be reached: {err}") from err
    return counts


def gone(ranks: list[int], before: dict[int, int] | None = None) -> list[int] | None:
    """The ranks of ``ranks`` that stopped beating without leaving: over the :data:`SILENCE_S` seconds
    since ``before`` (:func:`beats`), or, without ``before``, over the next :data:`SILENCE_S` seconds
    (this call waits). ``None`` when this rank has no heartbeat.

    Raises:
        StoreLost: the store cannot be reached.
    """
    if before is None:
        before = beats(ranks)
        if before is None:
            return None
        time.sleep(SILENCE_S)
    after = beats(ranks)
    if after is None:
        return None
    return [r for r in ranks if after[r] != -1 and after[r] == before.get(r)]


def store_holder() -> str:
    """Whose process holds the job's store: torchrun's agent, or rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "held by torchrun's agent"
    return "held by rank 0's process"


def describe(rank: int) -> str:
    """``"rank R (stage S)"`` (the stage where the job's layout is known)."""
    layout = _names.get("layout")
    if layout is None or not 0 <= rank < layout.world_size:
        return f"rank {rank}"
    return f"rank {rank} (stage {layout.stage_of(rank)})"


def store_rank() -> int | None:
    """The rank whose process holds the job's store (0), or ``None`` where torchrun's agent holds it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def lost(ranks: list[int], before: dict[int, int] | None = None) -> str | None:
    """Which of ``ranks`` are gone (:func:`gone`), said for a message: ``"rank 1 (stage 0) died or lost
    its connection (no heartbeat for 2.5 s)"``, or that the rank holding the store is; ``None`` when
    every one of them is alive or left on purpose, or this rank has no heartbeat."""
    try:
        missing = gone(ranks, before)
    except StoreLost as err:
        holder = store_rank()
        who = describe(holder) if holder is not None else "torchrun's agent"
        _state["lost"] = (None, f"{who} died or lost its connection ({err})")
        return str(_state["lost"][1])
    if not missing:
        return None
    verb = "died or lost its connection" if len(missing) == 1 else "died or lost their connections"
    said = f"{', '.join(describe(r) for r in missing)} {verb} (no heartbeat for {SILENCE_S:g} s)"
    _state["lost"] = (set(missing), said)
    return said


def known_lost(ranks: list[int]) -> str | None:
    """What :func:`lost` last said, where it concerns one of ``ranks`` (a rank that is gone stays gone)."""
    known = _state.get("lost")
    if known is None or (known[0] is not None and not known[0] & set(ranks)):
        return None
    return str(known[1])


def _await_others(timeout: float) -> None:
    """The store's holder waits (up to ``timeout`` seconds) for every other rank to have left: their last
    reads of the store (who is gone, a failure's note) still find it."""
    reader, rank = _state.get("reader"), _state.get("rank")
    lost: set[int] = (_state.get("lost") or (set(), ""))[0] or set()  # those known gone never leave
    keys = [f"{_LEFT}{r}" for r in range(int(_state.get("world", 1))) if r != rank and r not in lost]
    deadline = time.monotonic() + timeout
    while keys and reader is not None and time.monotonic() < deadline:
        try:
            if reader.check(keys):
                return
        except Exception:  # noqa: BLE001 - the store is gone already
            return
        time.sleep(0.05)
