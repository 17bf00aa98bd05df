"""Point-to-point messages between stages: :class:`P2P`, with receives posted ahead and deferred send waits.

A message is what :mod:`lightning_gpipe.transport.wire` encodes: a fixed-size header, then the
tensors it describes. On CPU (Gloo) it travels as :mod:`lightning_gpipe.transport.prefetch` lays
it out (a frame, or a header and one payload), so that its receive can be posted before the stage
takes it (:meth:`P2P.post`, run by the schedule's :class:`~lightning_gpipe.schedule.Post` actions);
on CUDA (NCCL) as the header, then each tensor, received when the stage takes it. Sends are
asynchronous (``isend``) and their waits are deferred to :meth:`P2P.flush`, so a stage computes
micro-batch ``i+1`` while micro-batch ``i`` travels; on CPU a thread waits for the sends as they
complete and frees their buffers. Transport is ``torch.distributed`` with global ranks: Gloo on
CPU, NCCL on CUDA; on Gloo the messages between the ranks of a pipeline travel on :class:`Lanes`,
one process group per direction.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.transport import ops, prefetch
from lightning_gpipe.transport.send_waiter import SendWaiter
from lightning_gpipe.transport.structure import Structure
from lightning_gpipe.transport.wire import HEADER_SLOTS, Meta, decode_header, decode_message, encode_message

__all__ = ["Lanes", "P2P", "release_connections", "waited_on"]


class Lanes:
    """One process group per direction between the ranks of a pipeline: messages to a higher
    global rank travel on ``upward``, messages to a lower one on ``downward``.

    On Gloo both directions between two ranks otherwise share one socket, and with it one lock
    (its *pair*'s): a send posted into a receive already waiting writes its bytes from the caller's
    thread while holding that lock, and meanwhile the process's Gloo event loop, woken by the bytes
    arriving the other way, finds the lock taken and polls again at once (``Pair::handleEvents``
    takes it with ``try_lock``): a busy loop on a core the layers need, for as long as the write
    lasts.
    On lanes each socket carries one direction's bytes, and a send never holds the lock that the
    reads of the other direction need.

    A Gloo group's sockets close only when nothing holds the group any more (destroying the
    process groups does not close them), so the lanes are the only holder of their groups and
    :func:`release_connections` drops them: after a failure, a peer waiting for this rank then sees the
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


def release_connections() -> None:
    """Drop every :class:`Lanes`' groups and every :class:`P2P`'s receives posted ahead (after the
    process groups are destroyed: at exit, after a failure): a posted receive holds its group's
    connection open, so a peer whose sends wait for it would wait for good."""
    for lanes in list(_LANES):
        lanes.close()
    for p2p in list(_P2PS):
        p2p.drop_posted()


class P2P:
    """Send and receive values between global ranks, with receives posted ahead and deferred send
    waits.

    :meth:`post` posts the receives of a source's next message not yet posted; :meth:`recv` takes
    the source's oldest posted message, or posts and takes one now. A message posted is taken in
    order (the transport matches receives to a source's messages in the order both were posted),
    so every receive posted must be taken: the schedule's actions post exactly the messages their
    columns take (:func:`~lightning_gpipe.schedule.with_posts`, checked by
    :func:`~lightning_gpipe.schedule.validate`). On CUDA :meth:`post` does nothing.

    The send waiter's thread (:class:`~lightning_gpipe.transport.send_waiter.SendWaiter`) outlives a
    phase: it lingers for the next send before it ends, so a step starts no thread.

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
        self._waiter = SendWaiter()  # background: waits for the sends posted, in order
        self.packed = device.type == "cpu"  # Gloo: transport.prefetch's layout, receives posted ahead
        self._rooms_to: dict[int, prefetch.Rooms] = defaultdict(prefetch.Rooms)  # per destination
        self._rooms_from: dict[int, prefetch.Rooms] = defaultdict(prefetch.Rooms)  # per source
        self._posted: dict[int, deque[prefetch.Posted]] = defaultdict(deque)  # per source, oldest first
        _P2PS.add(self)

    def send(
        self, tensors: Sequence[Tensor], dst: int, *, structure: Structure | None = None, chunks: int = 0
    ) -> None:
        """Send ``tensors`` (the value ``structure`` describes; ``None``: a tuple of tensors) to
        ``dst`` (:func:`~lightning_gpipe.transport.wire.encode_message`) asynchronously; waits
        happen in :meth:`flush`.

        The sends are posted here, in the calling thread, so their first bytes leave at once; with
        background transport a thread then waits for them to complete and drops what they hold.
        Like any asynchronous send, ``tensors`` must not change until it completes. The sends open
        no profiler event (:func:`lightning_gpipe._compat.unrecorded`): a wait deferred past the
        profiler's next step would close it in a freed event list.

        Raises:
            ValueError: a tensor that cannot travel (:func:`~lightning_gpipe.transport.wire.encode_message`).
            RuntimeError: (or the transport's own error) posting failed, e.g. the peer went away.
        """
        message = encode_message(tensors, structure, chunks, self.device)
        group = self._group(self._me(), dst)
        laid = prefetch.parts(message, self._rooms_to[dst]) if self.packed else [(t, 0) for t in message]
        posted: list[tuple[dist.Work, Tensor]] = []
        try:
            for t, tag in laid:
                posted.append((ops.isend(t, dst, group, tag), t))
        finally:  # what was posted is waited for, even where a later post failed
            if posted and self.background:
                self._waiter.put(posted)  # the waiter holds the tensors until the sends complete
            elif posted:
                self._pending += posted

    def post(self, src: int) -> None:
        """Post the receives of the next message from ``src`` not yet posted (on CPU; on CUDA
        nothing: the receive is posted when :meth:`recv` takes it).

        Raises:
            RuntimeError: more than :data:`~lightning_gpipe.schedule.POSTED_AHEAD` + 1 messages
                from ``src`` posted and not taken; or (or the transport's own error) posting
                failed, e.g. the peer went away.
        """
        if self.packed:
            queue, rooms = self._posted[src], self._rooms_from[src]
            group = self._group(src, self._me())
            queue.append(prefetch.post(src, group, rooms, rooms.count + len(queue), self.device))

    def recv(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Receive one message from ``src``: the oldest posted (:meth:`post`), or one posted now.

        Raises:
            RuntimeError: (or the transport's own error) the receive failed, e.g. the peer went away;
                the receives still posted from ``src`` are then dropped.
        """
        group = self._group(src, self._me())
        try:
            if not self.packed:
                return self._recv_now(src, group)
            queue = self._posted[src]
            try:
                if not queue:
                    self.post(src)
                return prefetch.take(queue.popleft(), self._rooms_from[src], src, group)
            except BaseException:
                queue.clear()
                raise
        except BaseException as err:
            waited_on(err, src)
            raise

    def _recv_now(self, src: int, group: Any) -> tuple[Meta, list[Tensor]]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        ops.irecv(header, src, group).wait()
        meta = decode_header(header)
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype, _ in meta.specs]
        if meta.blob:
            tensors.append(torch.empty(meta.blob, dtype=torch.uint8, device=self.device))
        for work in [ops.irecv(t, src, group) for t in tensors]:
            work.wait()
        return decode_message(meta, tensors)

    def drop_posted(self) -> None:
        """Let go of every receive posted ahead and not taken (:func:`release_connections`)."""
        self._posted.clear()

    def posted(self, src: int) -> int:
        """Messages from ``src`` whose receives are posted and not yet taken."""
        return len(self._posted[src]) if src in self._posted else 0

    def _me(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank()
        return self._rank

    def _group(self, src: int, dst: int) -> Any:
        return self.lanes.group(src, dst) if self.lanes is not None else None

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


_P2PS: weakref.WeakSet[P2P] = weakref.WeakSet()


def waited_on(err: BaseException, peer: int) -> None:
    """Remember on ``err`` the global rank whose message this rank was waiting for (``err.gpipe_peer``),
    which the failure report names (:func:`lightning_gpipe.transport.failure.report_and_abort`)."""
    with contextlib.suppress(AttributeError, TypeError):
        err.gpipe_peer = peer  # type: ignore[attr-defined]
