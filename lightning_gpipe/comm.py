"""Point-to-point transport between stages: :class:`P2P` and its background threads.

A message is what :mod:`lightning_gpipe.wire` encodes: a header, then the tensors it describes
(on CPU framed in one buffer). Sends are posted by the stage's thread and asynchronous (``isend``);
their waits are deferred to :meth:`P2P.flush` (on CPU a thread waits for the sends as they
complete and frees their buffers), so a stage computes micro-batch ``i+1`` while micro-batch ``i``
travels. Receives the stage knows are coming (:meth:`P2P.expect`: the rest of a phase's
micro-batches) are taken in the background, so that micro-batch ``i+1`` arrives while the stage
computes micro-batch ``i``. The background threads outlive a phase (:data:`LINGER_S`). Transport
is ``torch.distributed`` with global ranks: Gloo on CPU, NCCL on CUDA; on Gloo the messages
between the ranks of a pipeline travel on :class:`Lanes`, one process group per direction.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe._compat import unrecorded
from lightning_gpipe.microbatch import Structure
from lightning_gpipe.wire import (
    FIRST_ROOM,
    HEADER_SLOTS,
    Meta,
    decode_frame,
    decode_header,
    decode_message,
    encode_message,
    frame_message,
    unframe,
)

__all__ = ["LINGER_S", "Lanes", "P2P", "close_lanes", "join_receives"]


class Lanes:
    """One process group per direction between the ranks of a pipeline: messages to a higher
    global rank travel on ``upward``, messages to a lower one on ``downward``.

    On Gloo both directions between two ranks otherwise share one socket, and with it one lock
    (its *pair*'s): a send posted into a receive already waiting writes its bytes from the caller's
    thread while holding that lock, and meanwhile the process's Gloo event loop, woken by the bytes
    arriving the other way, finds the lock taken and polls again at once (``Pair::handleEvents``
    takes it with ``try_lock``): a busy loop on a core the layers need, for as long as the write
    lasts (up to several milliseconds a message on a busy 2-core host, BENCHMARKS.md section 17).
    On lanes each socket carries one direction's bytes, and a send never holds the lock that the
    reads of the other direction need.

    A Gloo group's sockets close only when nothing holds the group any more (destroying the
    process groups does not close them), so the lanes are the only holder of their groups and
    :func:`close_lanes` drops them: after a failure, a peer waiting for this rank then sees the
    connection close at once.

    Args:
        ranks: the pipeline's global ranks; messages to or from other ranks use the default group.
        upward: the group carrying messages from a rank to a higher one.
        downward: the group carrying messages from a rank to a lower one.
    """

    def __init__(self, ranks: Iterable[int], upward: Any, downward: Any) -> None:
        self.ranks = frozenset(ranks)
        self._groups: tuple[Any, Any] | None = (upward, downward)
        _LANES.add(self)

    @property
    def upward(self) -> Any:
        return self._groups[0] if self._groups is not None else None

    @property
    def downward(self) -> Any:
        return self._groups[1] if self._groups is not None else None

    def group(self, src: int, dst: int) -> Any:
        """The group a message from global rank ``src`` to ``dst`` travels on (``None``: the default
        group: a pair outside the pipeline, or lanes closed)."""
        groups = self._groups
        if groups is None or src not in self.ranks or dst not in self.ranks:
            return None
        return groups[0] if src < dst else groups[1]

    def close(self) -> None:
        """Drop the groups (later messages travel on the default group)."""
        self._groups = None


_LANES: weakref.WeakSet[Lanes] = weakref.WeakSet()


def close_lanes() -> None:
    """Drop every :class:`Lanes`' groups (after the process groups are destroyed: at exit, after a failure)."""
    for lanes in list(_LANES):
        lanes.close()


class P2P:
    """Send and receive tuples of tensors between global ranks, with deferred send waits.

    Receives are posted when :meth:`recv` asks, unless :meth:`expect` announced them: then a
    background thread per source takes the announced messages in order (each one's header, then its
    tensors) while the stage computes, and :meth:`recv` hands them out. The message *count* must
    be exact: a receive left posted would take a message meant for a later phase. The stage
    derives it from its schedule's actions (:func:`lightning_gpipe.schedule.messages`).

    The background threads outlive a phase: each waits up to :data:`LINGER_S` seconds for the next
    announcement (or send) before it ends, so a step starts none (a thread's start costs the
    stage's thread a scheduling round, on the critical path of a busy machine).

    Args:
        device: where received tensors are allocated (the stage's device).
        background: receive announced messages in a background thread, and wait for each send
            in another as it completes, dropping its buffer (default: on CPU devices, i.e. Gloo,
            whose send ``Work.is_completed()`` stays ``False`` until waited for; on CUDA every
            receive is posted when it is needed and :meth:`settle` polls the sends).
        lanes: the groups each direction travels on (default ``None``: every message on the
            default group).
    """

    def __init__(
        self, device: torch.device, background: bool | None = None, lanes: Lanes | None = None
    ) -> None:
        self.device = device
        self.lanes = lanes
        self._rank: int | None = None  # this process's global rank, once a message needs it
        self.background = device.type == "cpu" if background is None else background
        self._pending: list[tuple[dist.Work, object]] = []
        self._inboxes: dict[int, _Inbox] = {}
        self.framed = self.device.type == "cpu"  # Gloo: one buffer per message (frame_message)
        self._room_to: dict[int, int] = {}  # framed: the room each destination keeps for this sender
        self._room_from: dict[int, int] = {}  # framed: the room kept for each source
        self._waiter = _SendWaiter()  # background: waits for the sends posted, in order

    def send(
        self, tensors: Sequence[Tensor], dst: int, *, structure: Structure | None = None, chunks: int = 0
    ) -> None:
        """Send ``tensors`` (the value ``structure`` describes; ``None``: a tuple of tensors) to
        ``dst`` (:func:`~lightning_gpipe.wire.encode_message`) asynchronously; waits happen in :meth:`flush`.

        The message is encoded, framed (on CPU) and posted here, in the calling thread: the send
        costs the stage's thread the framing copy and the post, and its first bytes leave at once
        (handing it to a thread of its own cost each message a thread switch, about 0.14 ms of
        latency on a 2-vCPU machine: one-way 0.40 ms against 0.26 ms in a ping-pong). With
        background transport a thread then waits for the send to complete and drops its buffer.
        Like any asynchronous send, ``tensors`` must not change until it completes.

        Raises:
            ValueError: a tensor that cannot travel (:func:`~lightning_gpipe.wire.encode_message`).
            RuntimeError: (or the transport's own error) posting failed, e.g. the peer went away.

        The sends open no profiler event (:func:`lightning_gpipe._compat.unrecorded`): a wait deferred
        past the profiler's next step would close it in a freed event list."""
        message = encode_message(tensors, structure, chunks, self.device)
        group = self.lanes.group(self._me(), dst) if self.lanes is not None else None
        for t in self.frame(message, dst):
            work = _post(t, dst, group)
            if self.background:
                self._waiter.put(work, t)  # the waiter keeps the buffer until the send completes
            else:
                self._pending.append((work, t))

    def _me(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def frame(self, message: list[Tensor], dst: int) -> list[Tensor]:
        """What travels to ``dst`` for an encoded ``message``: framed on CPU (called in send order)."""
        if self.framed:
            room = self._room_to.get(dst, FIRST_ROOM)
            message, total = frame_message(message, room)
            self._room_to[dst] = max(room, total)
        return message

    def expect(self, src: int, messages: int) -> None:
        """Announce that the next ``messages`` receives from ``src`` follow in this phase; take them early.

        Raises:
            RuntimeError: messages announced earlier from ``src`` are not all taken yet.
        """
        if messages <= 0 or not self.background:
            return
        inbox = self._inboxes.get(src)
        if inbox is not None and inbox.left:
            raise RuntimeError(f"messages announced from rank {src} are still to be received")
        if inbox is None:
            inbox = self._inboxes[src] = _Inbox(self, src)
        inbox.order(messages)

    def recv(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Receive one message from ``src``: its header, then its tensors (allocated from the header)."""
        inbox = self._inboxes.get(src)
        if inbox is None or not inbox.left:
            return self.receive_now(src)
        return inbox.take()

    def receive_now(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Post the receives of one message from ``src`` and wait for them (in the calling thread)."""
        group = self.lanes.group(src, self._me()) if self.lanes is not None else None
        if not self.framed:
            header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
            _wait(dist.irecv(header, src, group=group))
            return self._receive_tensors(decode_header(header), src, group)
        room = self._room_from.get(src, FIRST_ROOM)
        buffer = torch.empty(room, dtype=torch.uint8, device=self.device)
        _wait(dist.irecv(buffer, src, group=group))
        total, fused, meta = decode_frame(buffer)
        self._room_from[src] = max(room, total)
        if not fused:
            return self._receive_tensors(meta, src, group)
        # a buffer sized for a larger earlier message is not held by a smaller one's tensors
        return decode_message(meta, unframe(buffer, meta, copy=room - total > room // 8))

    def _receive_tensors(self, meta: Meta, src: int, group: Any) -> tuple[Meta, list[Tensor]]:
        """The tensors ``meta`` announces, each received as a message of its own (on ``group``)."""
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype, _ in meta.specs]
        if meta.blob:
            tensors.append(torch.empty(meta.blob, dtype=torch.uint8, device=self.device))
        works = [dist.irecv(t, src, group=group) for t in tensors]
        for w in works:
            _wait(w)
        return decode_message(meta, tensors)

    def flush(self) -> None:
        """Wait for every posted send.

        Raises:
            RuntimeError: (or the transport's own error) a send failed, e.g. its peer went away.
        """
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
        self._waiter.close()

    def settle(self) -> None:
        """Forget the sends that have completed (their buffers may be freed), without waiting.

        With background transport (Gloo) a thread waits for each send as it is posted and drops
        its buffer once the peer has it: a Gloo send's ``Work.is_completed()`` stays ``False``
        until ``wait()`` is called, so polling it would keep every buffer to :meth:`flush`.

        Raises:
            RuntimeError: (or the transport's own error) a send failed in the background; raised
                here, not only at the next :meth:`flush`, which a stage that sends as it goes
                reaches only at the end of its column.
        """
        self._waiter.raise_error()
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]

    def sends_in_flight(self) -> int:
        """Sends posted whose buffers are still held (not yet known to have completed)."""
        return len(self._pending) + self._waiter.held


LINGER_S = 5.0
"""Seconds an idle background thread of :class:`P2P` (a source's receiver, the send waiter) waits
for more work before it ends."""


class _Background:
    """A daemon thread that works while :meth:`_has_work` and, idle, lingers :data:`LINGER_S` seconds
    for more before it ends; busy, it counts in :func:`join_receives`.

    Subclasses hold their work under ``self._cond`` and call :meth:`_wake` after adding some."""

    name = "gpipe-background"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _work(self) -> None:
        """Do one unit of work (called without the lock)."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Under ``self._cond``: work arrived; start the thread if none runs, count it busy."""
        if self._thread is None:  # a failed start raises here, leaving nothing half-started
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            thread.start()  # it waits for this lock: _thread is set before it looks
            self._thread = thread
        else:
            self._cond.notify_all()
        _busy(self, True)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._has_work():
                    _busy(self, False)
                    self._cond.notify_all()  # those waiting for the work to be done
                    if not self._cond.wait_for(self._has_work, timeout=LINGER_S):
                        self._thread = None
                        return
            self._work()


class _Inbox(_Background):
    """Receives the messages announced from ``src`` in order, for :meth:`P2P.recv` to take.

    A receive that fails (a peer went away, the group was destroyed after a failure elsewhere)
    is handed to the stage as its exception, and the rest of the announcement is dropped.
    """

    def __init__(self, p2p: P2P, src: int) -> None:
        super().__init__()
        self.name = f"gpipe-recv-from-{src}"
        self.p2p, self.src = p2p, src
        self.left = 0  # announced and not yet taken (the stage's thread)
        self._orders = 0  # announced and not yet received (under the lock)
        self._box: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def order(self, messages: int) -> None:
        with self._cond:
            self._orders += messages
            try:
                self._wake()
            except BaseException:
                self._orders -= messages
                raise
        self.left += messages

    def _has_work(self) -> bool:
        return self._orders > 0

    def _work(self) -> None:
        try:
            item: Any = self.p2p.receive_now(self.src)
        except BaseException as err:  # noqa: BLE001 - handed to the stage, which raises it
            with self._cond:
                self._orders = 0  # the rest of the announcement is not received
            self._box.put(err)
            return
        with self._cond:
            self._orders -= 1
        self._box.put(item)

    def take(self) -> tuple[Meta, list[Tensor]]:
        item = self._box.get()
        self.left -= 1
        if isinstance(item, BaseException):
            self.left = 0
            raise item
        return item


class _InOrder(_Background):
    """Handles the items :meth:`put` gives it in its thread, one at a time, in order.

    :meth:`close` waits until every item put so far is handled and raises the first handling
    error, if any (the items after it are then dropped unhandled).
    """

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[tuple[Any, ...]] = deque()
        self._error: BaseException | None = None

    def put(self, *item: Any) -> None:
        with self._cond:
            self._items.append(item)
            try:
                self._wake()
            except BaseException:
                self._items.pop()
                raise

    def _handle(self, *item: Any) -> None:
        raise NotImplementedError

    def _has_work(self) -> bool:
        return bool(self._items)

    def _work(self) -> None:
        with self._cond:
            item = self._items[0]
        if self._error is None:
            try:
                self._handle(*item)
            except BaseException as err:  # noqa: BLE001 - raised by close, in the stage's thread
                self._error = err
        with self._cond:
            self._items.popleft()  # what it held goes now

    def close(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._items)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def raise_error(self) -> None:
        """Raise the handling error, if any, without waiting (kept: the items after it are still
        dropped, and :meth:`close` raises it again)."""
        error = self._error
        if error is not None:
            raise error


class _SendWaiter(_InOrder):
    """Waits, in a thread, for the sends :meth:`P2P.send` posts (``put(work, buffer)``), in order,
    and drops each buffer once its send has completed, so that a stage that sends as it goes
    (1F1B) frees what it sent as the peer takes it rather than at the step's :meth:`P2P.flush`."""

    name = "gpipe-send-wait"

    @property
    def held(self) -> int:
        """Sends put whose buffers are still held."""
        with self._cond:
            return len(self._items)

    def _handle(self, work: dist.Work, buffer: Tensor) -> None:  # type: ignore[override]
        work.wait()


def _post(t: Tensor, dst: int, group: Any = None) -> dist.Work:
    """``dist.isend(t, dst, group)`` (``dst`` a global rank), with no profiler event
    (:func:`lightning_gpipe._compat.unrecorded`)."""
    with unrecorded():  # the send may complete after the profiler's next cycle began
        work = dist.isend(t, dst, group=group)
    assert work is not None
    return work


def _wait(work: dist.Work | None) -> None:
    assert work is not None
    work.wait()


_BUSY: set[_Background] = set()  # background receivers and send waiters with work in hand
_BUSY_CHANGED = threading.Condition()


def _busy(worker: _Background, busy: bool) -> None:
    with _BUSY_CHANGED:
        if busy:
            _BUSY.add(worker)
        else:
            _BUSY.discard(worker)
            _BUSY_CHANGED.notify_all()


def join_receives(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the background receives (and send waits) still in hand.

    Returns:
        ``True`` when none is left in hand (idle background threads hold no transport work).
    """
    with _BUSY_CHANGED:
        return _BUSY_CHANGED.wait_for(lambda: not _BUSY, timeout=timeout)
