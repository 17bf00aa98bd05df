"""Receives posted before the stage takes their messages, on Gloo: rooms, frames and packed payloads.

On Gloo a message's bytes leave the sender only once the receiver has posted a receive for them,
so a receive posted when the stage needs its message puts a round trip and the transfer on the
stage's critical path (twice: the header, then the tensors it announces). The schedule posts
receives ahead (:class:`~lightning_gpipe.schedule.Post`, placed by
:func:`~lightning_gpipe.schedule.with_posts`), but a receive needs its buffer's size before the
message's header has come. So on CPU a message travels as a header and one *payload*: every tensor's
bytes packed into one buffer (:func:`pack`), received into a buffer of the *room* both sides derive
from the messages before it (:class:`Rooms`); a payload over its room sends its tensors after it, on
a tag of their own. A message whose room is small travels as one *frame*, its header then its
payload in one buffer, so a message costs one transfer.

:class:`~lightning_gpipe.transport.p2p.P2P` uses this module for every message on CPU, posted ahead
or not; on CUDA (NCCL) messages are the header then each tensor, received when the stage takes them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.schedule import POSTED_AHEAD
from lightning_gpipe.transport import ops
from lightning_gpipe.transport.wire import HEADER_SLOTS, Meta, decode_header_bytes, decode_message

__all__ = [
    "FIRST_ROOM",
    "FRAMED_ROOM",
    "HEADER_BYTES",
    "HEADER_TAG",
    "OVERFLOW_TAG",
    "PAYLOAD_TAG",
    "Posted",
    "Rooms",
    "pack",
    "parts",
    "payload_bytes",
    "post",
    "take",
    "unpack",
]

FIRST_ROOM = 64 * 1024
"""Bytes a receiver takes a source's first payloads into (the room grows with larger payloads)."""
FRAMED_ROOM = FIRST_ROOM
"""A message whose room is at most this many bytes travels as one frame (its header, then its
payload, copied into one buffer); a larger room, as its header and then its payload."""
HEADER_BYTES = HEADER_SLOTS * 8
HEADER_TAG, PAYLOAD_TAG, OVERFLOW_TAG = 0, 1, 2
"""Tags of a message's header, of its payload (or frame) and of the tensors of a payload over its room."""
_ALIGN = 16  # every tensor starts at a multiple of 16 bytes: aligned for every dtype that travels
_PLACEHOLDER = torch.zeros(_ALIGN, dtype=torch.uint8)  # the payload of a message over its room (or empty)


class Rooms:
    """The room each payload between two ranks travels in, derived alike by both sides.

    Message ``m``'s room is the largest payload before message ``m - POSTED_AHEAD`` (at least
    :data:`FIRST_ROOM`): the receiver posts message ``m``'s receive once it has taken message
    ``m - POSTED_AHEAD - 1`` (:data:`~lightning_gpipe.schedule.POSTED_AHEAD` messages ahead of the
    one it takes next), before it knows the sizes of the messages after.
    """

    def __init__(self) -> None:
        self.count = 0  # messages sent (taken) so far
        # the rooms of messages count .. count + POSTED_AHEAD
        self._rooms: deque[int] = deque([FIRST_ROOM] * (POSTED_AHEAD + 1), maxlen=POSTED_AHEAD + 1)
        # receiver: the shape, dtype and bytes (unpadded) of the last message taken whose payload was
        # one tensor at least as large as its room (None after one of several tensors); post receives
        # into a tensor of that shape only where its bytes are the room's, exactly
        self.single: tuple[tuple[int, ...], torch.dtype, int] | None = None

    def room(self, m: int) -> int:
        """Message ``m``'s room in bytes.

        Raises:
            RuntimeError: ``m`` is not within ``count .. count + POSTED_AHEAD`` (a receive posted
                further ahead than the rooms reach).
        """
        if not 0 <= m - self.count <= POSTED_AHEAD:
            raise RuntimeError(
                f"message {m}'s receive is posted more than {POSTED_AHEAD} messages ahead of message "
                f"{self.count}, the next one taken; post receives with schedule.with_posts"
            )
        return self._rooms[m - self.count]

    def record(self, total: int) -> None:
        """The next message's (``count``) payload was ``total`` bytes."""
        self.count += 1
        self._rooms.append(max(self._rooms[-1], total))


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _specs(meta: Meta) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor that travels for ``meta``, the structure's blob last."""
    specs = [(shape, dtype) for shape, dtype, _ in meta.specs]
    if meta.blob:
        specs.append(((meta.blob,), torch.uint8))
    return specs


def payload_bytes(meta: Meta) -> int:
    """The bytes of the payload :func:`pack` makes of the tensors ``meta`` describes (each padded
    to 16 bytes)."""
    return sum(_padded(math.prod(shape) * dtype.itemsize) for shape, dtype in _specs(meta))


def pack(tensors: Sequence[Tensor], room: int) -> tuple[Tensor, list[Tensor], int]:
    """The tensors of a message (after its header) as what travels to a peer that keeps ``room``
    bytes for its payload: ``(payload, overflow, total)``.

    ``total`` is the payload's size in bytes, each tensor padded to 16 (:func:`payload_bytes`).
    Within ``room``, ``payload`` holds every tensor's bytes and ``overflow`` is empty: a single
    tensor travels as it is (its own memory and dtype, no copy: Gloo sends bytes), several are
    copied into one uint8 buffer.
    Larger, ``payload`` is a 16-byte placeholder that takes the receive posted for it, and the
    tensors travel as ``overflow``, each a message of its own; both sides then keep ``max(room,
    total)`` for later payloads. Empty (``total`` 0), the placeholder travels alone.
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(_padded(n) for n in sizes)
    if total > room:
        return _PLACEHOLDER, list(tensors), total
    if total == 0:
        return _PLACEHOLDER, [], 0
    if len(tensors) == 1:
        return tensors[0], [], total
    buffer = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for t, n in zip(tensors, sizes):
        buffer[offset : offset + n] = _bytes(t)
        offset += _padded(n)
    return buffer, [], total


def _bytes(t: Tensor) -> Tensor:
    """Contiguous ``t``'s memory as a flat uint8 tensor."""
    return t.reshape(-1).view(torch.uint8)


def unpack(buffer: Tensor, meta: Meta, copy: bool = False) -> list[Tensor]:
    """The tensors of a payload (:func:`pack`, within its room) received into ``buffer``.

    Each one is a tensor on ``buffer``'s memory, not a view of it: its own autograd version
    counter, so an in-place change of one tensor of a message leaves the others' saved versions
    alone. Copies instead with ``copy`` (a buffer much larger than its message is then not held)
    and where the tensors' dtypes differ (``torch.save`` refuses one storage as several types).
    """
    specs = _specs(meta)
    copy = copy or len({dtype for _, dtype in specs}) > 1
    storage = buffer.untyped_storage()
    tensors, offset = [], 0
    start = buffer.storage_offset() * buffer.element_size()  # a frame's payload follows its header
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if copy:
            t = buffer[offset : offset + nbytes].view(dtype).view(shape).clone()
        else:  # offsets are multiples of 16 bytes: whole elements of every dtype
            strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]  # contiguous
            t = torch.empty(0, dtype=dtype, device=buffer.device)
            t.set_(storage, (start + offset) // dtype.itemsize, shape, strides)
        tensors.append(t)
        offset += _padded(nbytes)
    return tensors


def parts(message: Sequence[Tensor], rooms: Rooms) -> list[tuple[Tensor, int]]:
    """What travels for an encoded ``message`` (``[header, *tensors]``) to the peer whose rooms are
    ``rooms``, each with its tag, in order; called in send order.

    One frame where the message's room is at most :data:`FRAMED_ROOM` bytes, else the header and
    the payload; then the tensors of a payload over its room on :data:`OVERFLOW_TAG`.
    """
    header, *tensors = message
    room = rooms.room(rooms.count)
    payload, overflow, total = pack(tensors, room)
    rooms.record(total)
    rest = [(t, OVERFLOW_TAG) for t in overflow]
    if room <= FRAMED_ROOM:  # one frame: copying a small payload costs less than a second transfer
        payload = _bytes(payload)
        frame = torch.empty(HEADER_BYTES + payload.numel(), dtype=torch.uint8, device=header.device)
        frame[:HEADER_BYTES] = header.view(torch.uint8)
        frame[HEADER_BYTES:] = payload
        return [(frame, PAYLOAD_TAG), *rest]
    return [(header, HEADER_TAG), (payload, PAYLOAD_TAG), *rest]


@dataclass
class Posted:
    """The receives posted for one message: its header's (``None`` where it comes in its frame) and
    its payload's, with their buffers."""

    header_work: dist.Work | None
    header: Tensor
    payload_work: dist.Work
    payload: Tensor


def post(src: int, group: Any, rooms: Rooms, m: int, device: torch.device) -> Posted:
    """Post the receives of message ``m`` from global rank ``src`` on ``group``, whose rooms are
    ``rooms``: one frame's within :data:`FRAMED_ROOM`, else the header's and then the payload's.

    Where the last message taken from ``src`` was one tensor that fills message ``m``'s room, the
    payload is received into a tensor of its shape and dtype (:attr:`Rooms.single`), which
    :func:`take` hands on as it is when the message is alike (the steady state: every micro-batch's
    activation, every gradient).
    """
    room = rooms.room(m)
    if room <= FRAMED_ROOM:
        frame = torch.empty(HEADER_BYTES + room, dtype=torch.uint8, device=device)
        work = ops.irecv(frame, src, group, PAYLOAD_TAG)
        return Posted(None, frame[:HEADER_BYTES].view(torch.int64), work, frame[HEADER_BYTES:])
    header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)
    single = rooms.single
    if single is not None and single[2] == room:
        payload = torch.empty(single[0], dtype=single[1], device=device)
    else:
        payload = torch.empty(room, dtype=torch.uint8, device=device)
    header_work = ops.irecv(header, src, group, HEADER_TAG)
    return Posted(header_work, header, ops.irecv(payload, src, group, PAYLOAD_TAG), payload)


def take(posted: Posted, rooms: Rooms, src: int, group: Any) -> tuple[Meta, list[Tensor]]:
    """The message whose receives ``posted`` holds, once arrived; the tensors of a payload over its
    room are received now (on :data:`OVERFLOW_TAG`).

    Raises:
        RuntimeError: (or the transport's own error) the receive failed, e.g. the peer went away.
    """
    posted.payload_work.wait()  # a frame, or sent after the header on the same connection
    if posted.header_work is not None:
        posted.header_work.wait()
    meta = decode_header_bytes(posted.header.numpy().tobytes())
    payload, specs = posted.payload, meta.specs
    total, room = payload_bytes(meta), payload.nbytes
    rooms.record(total)
    single = len(specs) == 1 and not meta.blob
    if not single:
        rooms.single = None
    elif total >= room:  # a shorter one leaves the steady state's shape in place
        shape, dtype, _ = specs[0]
        rooms.single = (shape, dtype, math.prod(shape) * dtype.itemsize)  # its bytes, unpadded
    if total > room:
        device = payload.device
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in _specs(meta)]
        for work in [ops.irecv(t, src, group, OVERFLOW_TAG) for t in tensors]:
            work.wait()
        return decode_message(meta, tensors)
    if single and payload.shape == specs[0][0] and payload.dtype == specs[0][1]:
        return meta, [payload]  # received as it was sent
    # a buffer sized for a larger earlier message is not held by a smaller one's tensors
    return decode_message(meta, unpack(_bytes(payload), meta, copy=room - total > room // 8))
