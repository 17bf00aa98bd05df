"""Point-to-point transport between stages: :class:`P2P`, its receives posted ahead and its send waiter.

A message is what :mod:`lightning_gpipe.transport.wire` encodes: a header, then the tensors it describes
(on CPU their bytes in one payload; a small payload travels in one frame with its header, a large
one after it, :data:`FRAMED_ROOM`). Sends are posted by the stage's thread and asynchronous (``isend``);
their waits are deferred to :meth:`P2P.flush` (on CPU a thread waits for the sends as they
complete and frees their buffers), so a stage computes micro-batch ``i+1`` while micro-batch ``i``
travels. Receives the stage knows are coming (:meth:`P2P.expect`: the rest of a phase's
micro-batches) are posted ahead on CPU, :data:`AHEAD` beyond the one the stage takes, so that
micro-batch ``i+1`` arrives while the stage computes micro-batch ``i``; the transport's own
thread fills them. Transport is ``torch.distributed`` with global ranks: Gloo on CPU, NCCL on CUDA;
on Gloo the messages between the ranks of a pipeline travel on :class:`Lanes`, one process group
per direction.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe._compat import unrecorded
from lightning_gpipe.transport.structure import Structure
from lightning_gpipe.transport.wire import (
    FIRST_ROOM,
    HEADER_SLOTS,
    Meta,
    decode_header,
    decode_message,
    encode_message,
    pack,
    payload_bytes,
    unpack,
)

__all__ = ["LINGER_S", "Lanes", "P2P", "close_lanes", "join_sends"]


AHEAD = 2
"""Receives of announced messages posted beyond the one the stage takes next (:meth:`P2P.recv`)."""
FRAMED_ROOM = FIRST_ROOM
"""On CPU a message whose room is at most this many bytes travels as one frame (its header, then its
payload, copied into one buffer); a larger room, as its header and then its payload (BENCHMARKS.md section 21)."""
HEADER_BYTES = HEADER_SLOTS * 8
HEADER_TAG, PAYLOAD_TAG, OVERFLOW_TAG = 0, 1, 2
"""Tags of a message's header, of its payload (on CPU) and of the tensors of a payload larger than its room."""


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

    Receives are posted when :meth:`recv` asks, unless :meth:`expect` announced them: on CPU the
    first :data:`AHEAD` + 1 announced messages' receives (a frame, or header and payload) are then posted at
    once, and each message taken posts the next one's, its payload into a buffer of the room both
    sides derive (:class:`_Rooms`), so the transport's thread fills them while the stage computes. (A thread of ours taking them instead
    cost each message a second wake-up and its Python work, on the cores the layers need:
    BENCHMARKS.md section 18.) The message *count* must be exact: a receive left posted would take
    a message meant for a later phase. The stage derives it from its schedule's actions
    (:func:`lightning_gpipe.schedule.messages`).

    The send waiter's thread outlives a phase: it waits up to :data:`LINGER_S` seconds for the next
    send before it ends, so a step starts none (a thread's start costs the stage's thread a
    scheduling round, on the critical path of a busy machine).

    Args:
        device: where received tensors are allocated (the stage's device).
        background: wait for each send in a thread as it completes, dropping its buffer (default:
            on CPU devices, i.e. Gloo, whose send ``Work.is_completed()`` stays ``False`` until
            waited for; on CUDA :meth:`settle` polls the sends).
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
        self._ahead: dict[int, _Ahead] = {}  # per source: the announced receives and those posted
        self.packed = self.device.type == "cpu"  # Gloo: header and payload (wire.pack) per message
        self._rooms_to: dict[int, _Rooms] = defaultdict(_Rooms)  # packed: per destination
        self._rooms_from: dict[int, _Rooms] = defaultdict(_Rooms)  # packed: per source
        self._waiter = _SendWaiter()  # background: waits for the sends posted, in order

    def send(
        self, tensors: Sequence[Tensor], dst: int, *, structure: Structure | None = None, chunks: int = 0
    ) -> None:
        """Send ``tensors`` (the value ``structure`` describes; ``None``: a tuple of tensors) to
        ``dst`` (:func:`~lightning_gpipe.transport.wire.encode_message`) asynchronously; waits happen in :meth:`flush`.

        The message is encoded, packed (on CPU) and posted here, in the calling thread: the send
        costs the stage's thread the posts (and the copy of a payload of several tensors; one
        tensor travels as it is), and its first bytes leave at once (handing it to a thread of its
        own cost each message a thread switch, about 0.14 ms of latency on a 2-vCPU machine: one-way
        0.40 ms against 0.26 ms in a ping-pong). With background transport a thread then waits for
        the message's sends to complete and drops what they hold. Like any asynchronous send,
        ``tensors`` must not change until it completes.

        Raises:
            ValueError: a tensor that cannot travel (:func:`~lightning_gpipe.transport.wire.encode_message`).
            RuntimeError: (or the transport's own error) posting failed, e.g. the peer went away.

        The sends open no profiler event (:func:`lightning_gpipe._compat.unrecorded`): a wait deferred
        past the profiler's next step would close it in a freed event list."""
        message = encode_message(tensors, structure, chunks, self.device)
        group = self.lanes.group(self._me(), dst) if self.lanes is not None else None
        posted: list[tuple[dist.Work, Tensor]] = []
        try:
            for t, tag in self.parts(message, dst):
                posted.append((_post(t, dst, group, tag), t))
        finally:  # what was posted is waited for, even where a later post failed
            if posted and self.background:
                self._waiter.put(posted)  # the waiter holds the tensors until the sends complete
            elif posted:
                self._pending += posted

    def _me(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def parts(self, message: list[Tensor], dst: int) -> list[tuple[Tensor, int]]:
        """What travels to ``dst`` for an encoded ``message``, each with its tag: on CPU (called in
        send order) the header and the payload (:func:`~lightning_gpipe.transport.wire.pack`), in one frame
        where the message's room is at most :data:`FRAMED_ROOM` bytes, else one after the other;
        then the tensors of a payload larger than its room on :data:`OVERFLOW_TAG`."""
        if not self.packed:
            return [(t, HEADER_TAG) for t in message]
        header, *tensors = message
        rooms = self._rooms_to[dst]
        room = rooms.room(rooms.count)
        payload, overflow, total = pack(tensors, room)
        rooms.record(total)
        rest = [(t, OVERFLOW_TAG) for t in overflow]
        if room <= FRAMED_ROOM:  # one frame: copying a small payload costs less than a second message
            frame = torch.empty(HEADER_BYTES + payload.numel(), dtype=torch.uint8, device=header.device)
            frame[:HEADER_BYTES] = header.view(torch.uint8)
            frame[HEADER_BYTES:] = payload
            return [(frame, PAYLOAD_TAG), *rest]
        return [(header, HEADER_TAG), (payload, PAYLOAD_TAG), *rest]

    def expect(self, src: int, messages: int) -> None:
        """Announce that the next ``messages`` receives from ``src`` follow in this phase; post the
        first :data:`AHEAD` + 1 of them now, so that they arrive while the stage computes.

        Raises:
            RuntimeError: messages announced earlier from ``src`` are not all taken yet; or (or the
                transport's own error) posting failed, e.g. the peer went away: the announcement is dropped.
        """
        if messages <= 0 or not self.packed:  # NCCL: a message's size is known from its header
            return
        ahead = self._ahead.get(src)
        if ahead is None:
            ahead = self._ahead[src] = _Ahead()
        if ahead.left:
            raise RuntimeError(f"messages announced from rank {src} are still to be received")
        ahead.left = messages
        with ahead.dropped_on_error():
            self._post_ahead(src, ahead)

    def recv(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Receive one message from ``src``: its header, then its tensors (allocated from the header).

        An announced message (:meth:`expect`) was posted ahead; taking it posts the next one announced.

        Raises:
            RuntimeError: (or the transport's own error) the receive failed, e.g. the peer went away;
                the rest of an announcement is then dropped.
        """
        ahead = self._ahead.get(src)
        if ahead is None or not ahead.left:
            return self.receive_now(src)
        with ahead.dropped_on_error():
            if not ahead.posted:
                self._post_ahead(src, ahead)
            header, payload = ahead.posted.popleft()
            ahead.left -= 1
            message = self._take(src, header, payload)
            self._post_ahead(src, ahead)
        return message

    def _post_ahead(self, src: int, ahead: _Ahead) -> None:
        """Post the receives of ``src``'s announced messages until :data:`AHEAD` + 1 are posted (or
        all announced are), each payload's into a buffer of its room (:class:`_Rooms`)."""
        while len(ahead.posted) < min(AHEAD + 1, ahead.left):
            ahead.posted.append(self._post_message(src, len(ahead.posted)))

    def _group_from(self, src: int) -> Any:
        return self.lanes.group(src, self._me()) if self.lanes is not None else None

    def _post_message(self, src: int, later: int = 0) -> tuple[_Posted, _Posted]:
        """Post the receives of the message from ``src`` that follows the next ``later`` ones: in a
        room of at most :data:`FRAMED_ROOM` bytes one receive, of its frame (``(None, header)`` then
        the frame's payload); in a larger room the header's, then the payload's into a buffer of the room."""
        group, rooms = self._group_from(src), self._rooms_from[src]
        room = rooms.room(rooms.count + later)
        if room <= FRAMED_ROOM:
            frame = torch.empty(HEADER_BYTES + room, dtype=torch.uint8, device=self.device)
            work = _irecv(frame, src, group, PAYLOAD_TAG)
            return (None, frame[:HEADER_BYTES].view(torch.int64)), (work, frame[HEADER_BYTES:])
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        payload = torch.empty(room, dtype=torch.uint8, device=self.device)
        return (_irecv(header, src, group, HEADER_TAG), header), (
            _irecv(payload, src, group, PAYLOAD_TAG),
            payload,
        )

    def receive_now(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Post the receives of one message from ``src`` and wait for them (in the calling thread)."""
        if self.packed:
            return self._take(src, *self._post_message(src))
        group = self._group_from(src)
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        _wait(dist.irecv(header, src, group=group))
        return self._receive_tensors(decode_header(header), src, group)

    def _take(self, src: int, header: _Posted, payload: _Posted) -> tuple[Meta, list[Tensor]]:
        """The message from ``src`` whose header and payload receives were posted (its tensors
        received now where its payload was over its room: on :data:`OVERFLOW_TAG`)."""
        _wait(payload[0])  # a frame, or sent after the header on the same connection: both have arrived
        if header[0] is not None:
            _wait(header[0])
        meta = decode_header(header[1])
        total, buffer = payload_bytes(meta), payload[1]
        self._rooms_from[src].record(total)
        room = buffer.numel()
        if total > room:
            return self._receive_tensors(meta, src, self._group_from(src), OVERFLOW_TAG)
        # a buffer sized for a larger earlier message is not held by a smaller one's tensors
        return decode_message(meta, unpack(buffer, meta, copy=room - total > room // 8))

    def _receive_tensors(
        self, meta: Meta, src: int, group: Any, tag: int = HEADER_TAG
    ) -> tuple[Meta, list[Tensor]]:
        """The tensors ``meta`` announces, each received as a message of its own (on ``group``, ``tag``)."""
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype, _ in meta.specs]
        if meta.blob:
            tensors.append(torch.empty(meta.blob, dtype=torch.uint8, device=self.device))
        works = [dist.irecv(t, src, group=group, tag=tag) for t in tensors]
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
        """Sends posted whose tensors are still held (not yet known to have completed): with
        background transport, messages; otherwise the transport's sends."""
        return len(self._pending) + self._waiter.held


class _Rooms:
    """The room each payload between two ranks travels in, kept alike by both sides.

    Message ``m``'s room is the largest payload before ``m - AHEAD`` (at least :data:`FIRST_ROOM`):
    a receiver posts message ``m``'s buffer once it has taken message ``m - AHEAD - 1``
    (:data:`AHEAD` messages ahead of the one it takes), before it knows the sizes of the messages after.
    """

    def __init__(self) -> None:
        self.count = 0  # messages sent (taken) so far
        # the room of messages count .. count + AHEAD
        self._rooms: deque[int] = deque([FIRST_ROOM] * (AHEAD + 1), maxlen=AHEAD + 1)

    def room(self, m: int) -> int:
        """Message ``m``'s room in bytes (``count <= m <= count + AHEAD``)."""
        return self._rooms[m - self.count]

    def record(self, total: int) -> None:
        """The next message's (``count``) payload was ``total`` bytes."""
        self.count += 1
        self._rooms.append(max(self._rooms[-1], total))


_Posted = tuple[dist.Work | None, Tensor]  # a receive posted and its buffer (None: received in its frame)


class _Ahead:
    """The announced messages from one source: how many are still to be taken, and the receives
    posted for the first of them (oldest first, each the header's and the payload's)."""

    def __init__(self) -> None:
        self.left = 0
        self.posted: deque[tuple[_Posted, _Posted]] = deque()

    @contextmanager
    def dropped_on_error(self) -> Iterator[None]:
        """An error drops the rest of the announcement (its receives are not taken)."""
        try:
            yield
        except BaseException:
            self.left = 0
            self.posted.clear()
            raise


LINGER_S = 5.0
"""Seconds the idle send waiter's thread (:class:`_InOrder`) waits for more sends before it ends."""


class _InOrder:
    """Handles the items :meth:`put` gives it in a daemon thread, one at a time, in order; idle,
    the thread lingers :data:`LINGER_S` seconds for more before it ends; with items in hand it
    counts in :func:`join_sends`.

    :meth:`close` waits until every item put so far is handled and raises the first handling
    error, if any (the items after it are then dropped unhandled).
    """

    name = "gpipe-background"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
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

    def _wake(self) -> None:
        """Under ``self._cond``: an item arrived; start the thread if none runs, count it busy."""
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
                if not self._items:
                    _busy(self, False)
                    self._cond.notify_all()  # those waiting for the items to be handled
                    if not self._cond.wait_for(lambda: bool(self._items), timeout=LINGER_S):
                        self._thread = None
                        return
            self._handle_first()

    def _handle_first(self) -> None:
        """Handle the first item, then drop it (no frame of the lingering thread keeps it: a send's
        work holds its process group)."""
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
    """Waits, in a thread, for the sends of each message :meth:`P2P.send` posts (``put([(work,
    tensor), …])``), in order, and drops the message's tensors once its sends have completed, so
    that a stage that sends as it goes (1F1B) frees what it sent as the peer takes it rather than
    at the step's :meth:`P2P.flush`."""

    name = "gpipe-send-wait"

    @property
    def held(self) -> int:
        """Messages put whose tensors are still held."""
        with self._cond:
            return len(self._items)

    def _handle(self, posted: list[tuple[dist.Work, Tensor]]) -> None:  # type: ignore[override]
        for work, _ in posted:
            work.wait()


def _post(t: Tensor, dst: int, group: Any = None, tag: int = 0) -> dist.Work:
    """``dist.isend(t, dst, group, tag)`` (``dst`` a global rank), with no profiler event
    (:func:`lightning_gpipe._compat.unrecorded`)."""
    with unrecorded():  # the send may complete after the profiler's next cycle began
        work = dist.isend(t, dst, group=group, tag=tag)
    assert work is not None
    return work


def _irecv(t: Tensor, src: int, group: Any, tag: int) -> dist.Work:
    work = dist.irecv(t, src, group=group, tag=tag)
    assert work is not None
    return work


def _wait(work: dist.Work | None) -> None:
    assert work is not None
    work.wait()


_BUSY: set[_InOrder] = set()  # send waiters with sends in hand
_BUSY_CHANGED = threading.Condition()


def _busy(worker: _InOrder, busy: bool) -> None:
    with _BUSY_CHANGED:
        if busy:
            _BUSY.add(worker)
        else:
            _BUSY.discard(worker)
            _BUSY_CHANGED.notify_all()


def join_sends(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the send waits still in hand (:class:`_SendWaiter`).

    Returns:
        ``True`` when none is left in hand (idle waiter threads hold no transport work).
    """
    with _BUSY_CHANGED:
        return _BUSY_CHANGED.wait_for(lambda: not _BUSY, timeout=timeout)
