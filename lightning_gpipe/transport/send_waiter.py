"""A thread that waits for the sends of each message as they complete and lets go of their tensors.

A Gloo send's ``Work.is_completed()`` stays ``False`` until ``wait()`` is called, and a wait with a
timeout that expires fails the whole group, so only a thread blocked in ``wait()`` learns when a
send has completed without holding up the stage. A stage that sends as it goes (1F1B) then frees
what it sent as the peer takes it, rather than at the end of its column.

The stage's thread hands each message's sends over through a ``queue.SimpleQueue`` (a put and a
get in C, no Python condition variable per message).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

__all__ = ["LINGER_S", "SendWaiter", "join_sends"]

LINGER_S = 5.0
"""Seconds an idle :class:`SendWaiter`'s thread waits for more sends before it ends (a thread's start
costs the stage's thread a scheduling round, on the critical path of a busy machine)."""


class SendWaiter:
    """Waits, in a daemon thread, for the sends of each message :meth:`put` gives it (``[(work,
    tensor), …]``), in order, and drops the message once its sends have completed.

    Idle, the thread lingers :data:`LINGER_S` seconds for more before it ends; the next :meth:`put`
    starts another. :meth:`close` waits until every message put so far is dropped and raises the
    first error a wait raised, if any (the messages after it are dropped without waiting).
    """

    name = "gpipe-send-wait"

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a put and the idle thread's end, one at a time
        self._thread: threading.Thread | None = None
        self._put = 0  # messages put (written by the stage's thread only)
        self._dropped = 0  # messages dropped (written by the waiter's thread only)
        self._error: BaseException | None = None
        _WAITERS.add(self)

    @property
    def held(self) -> int:
        """Messages put whose tensors are still held."""
        return self._put - self._dropped

    def put(self, posted: list[tuple[Any, Any]]) -> None:
        """Hand over one message's sends (``(work, tensor)`` pairs); the thread holds the tensors until
        the sends complete.

        Raises:
            RuntimeError: the thread could not start (nothing is then held).
        """
        with self._lock:
            self._queue.put(posted)
            self._put += 1
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                try:
                    thread.start()
                except BaseException:
                    self._queue.get_nowait()  # with no thread the queue held nothing else
                    self._put -= 1
                    raise
                self._thread = thread

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=LINGER_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if isinstance(item, threading.Event):  # close(): every message before it is dropped
                item.set()
                continue
            if self._error is None:
                self._wait(item)
            del item  # what the message held goes now: no frame of the lingering thread keeps it
            self._dropped += 1

    def _wait(self, posted: list[tuple[Any, Any]]) -> None:
        try:
            for work, _ in posted:
                work.wait()
        except BaseException as err:  # noqa: BLE001 - raised by close, in the stage's thread
            self._error = err

    def close(self) -> None:
        """Wait until every message put so far is dropped; raise the first wait's error, if any."""
        if self.held:
            marker = threading.Event()
            with self._lock:  # a thread that runs now takes the marker before it may end
                if self._thread is not None:
                    self._queue.put(marker)
                else:  # it dropped every message and ended since the count was read
                    marker.set()
            marker.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def raise_error(self) -> None:
        """Raise the first wait's error, if any, without waiting (kept: the messages after it are still
        dropped, and :meth:`close` raises it again)."""
        error = self._error
        if error is not None:
            raise error


_WAITERS: weakref.WeakSet[SendWaiter] = weakref.WeakSet()


def join_sends(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until no :class:`SendWaiter` holds a message (at exit).

    Returns:
        ``True`` when none is left in hand (idle waiter threads hold no transport work).
    """
    deadline = time.monotonic() + timeout
    while any(waiter.held for waiter in list(_WAITERS)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True
