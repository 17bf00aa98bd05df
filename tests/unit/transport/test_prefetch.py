"""Receives posted ahead on CPU (:mod:`lightning_gpipe.transport.prefetch`): payloads packed into
rooms both sides derive alike, frames, overflow; and :class:`~lightning_gpipe.transport.p2p.P2P`
posting and taking them in order."""

import threading

import pytest
import torch
from torch import Tensor

from lightning_gpipe.engine.microbatch import flatten, unflatten
from lightning_gpipe.schedule import POSTED_AHEAD
from lightning_gpipe.transport import p2p as comm
from lightning_gpipe.transport import prefetch
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.prefetch import FIRST_ROOM, pack, payload_bytes, unpack
from lightning_gpipe.transport.wire import decode_header, decode_message, encode_message


def _packed_round_trip(tensors, structure=None, room=FIRST_ROOM):
    """The message's payload as packed for ``room`` and as the receiver reads it: ``(payload,
    overflow, total, meta, buffer)``, ``buffer`` the receiver's room holding what arrived."""
    header, *sent = encode_message(tensors, structure, 3, torch.device("cpu"))
    payload, overflow, total = pack(sent, room)
    meta = decode_header(header.clone())
    assert payload_bytes(meta) == total  # the receiver's own count of the payload
    buffer = torch.zeros(room, dtype=torch.uint8)  # the receiver's room, larger than the message
    raw = payload.reshape(-1).view(torch.uint8)
    buffer[: raw.numel()] = raw
    return payload, overflow, total, meta, buffer


def test_a_payload_within_the_room_is_one_aligned_buffer_every_dtype_and_shape_round_trips():
    tensors = [
        torch.randn(3, 5),
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        torch.randn(0, 4),  # empty
        torch.randn(7).half(),  # 14 bytes: the next tensor starts padded
        torch.randn(2, 3).bfloat16(),
        torch.arange(5, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex128),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    payload, overflow, total, meta, buffer = _packed_round_trip(tensors)
    assert not overflow and total == payload.numel() == 64 + 16 + 0 + 16 + 16 + 32 + 16 + 48 + 96
    for received in unpack(buffer, meta), unpack(buffer, meta, copy=True):
        for a, b in zip(received, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            assert a.untyped_storage().data_ptr() != buffer.data_ptr()  # copies: the dtypes differ


def test_a_payload_of_one_dtype_arrives_as_tensors_on_its_buffer_unless_copied():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.tensor(1.5)]
    _, _, _, meta, buffer = _packed_round_trip(tensors)
    views, copies = unpack(buffer, meta), unpack(buffer, meta, copy=True)
    for a, c, b in zip(views, copies, tensors):
        assert torch.equal(a, b) and torch.equal(c, b)
        assert a.untyped_storage().data_ptr() == buffer.data_ptr() != c.untyped_storage().data_ptr()
        assert a.data_ptr() % 16 == 0  # 7 floats are padded to 32 bytes: the next tensor is aligned


@pytest.mark.parametrize(
    "x", [torch.randn(6, 5), torch.arange(12, dtype=torch.int64).reshape(3, 4)[1:], torch.randn(4, 3).t()]
)
def test_one_tensor_travels_as_it_is_without_a_copy_when_it_is_contiguous(x):
    payload, overflow, total, meta, buffer = _packed_round_trip([x])
    assert not overflow and payload.dtype == x.dtype and payload.shape == x.shape  # Gloo sends bytes
    assert total == -(-x.numel() * x.element_size() // 16) * 16
    if x.is_contiguous():
        assert payload.data_ptr() == x.data_ptr()
    (received,) = unpack(buffer, meta)
    assert received.dtype == x.dtype and torch.equal(received, x)


def test_a_payload_over_the_room_sends_a_placeholder_then_the_tensors():
    x, y = torch.randn(150, 128), torch.arange(5)
    payload, overflow, total, meta, _ = _packed_round_trip([x, y], room=FIRST_ROOM)
    assert total > FIRST_ROOM and payload.numel() == 16 and len(overflow) == 2
    assert torch.equal(overflow[0], x) and torch.equal(overflow[1], y)
    again, overflow_again, total_again, _, _ = _packed_round_trip([x, y], room=total)  # the grown room
    assert not overflow_again and total_again == total == again.numel()


def test_a_message_of_empty_tensors_or_none_has_an_empty_payload_and_no_overflow():
    for tensors in [torch.randn(0, 4), torch.zeros(0, dtype=torch.int64)], []:
        payload, overflow, total, meta, buffer = _packed_round_trip(tensors)
        assert total == 0 and not overflow and payload.numel() == 16  # the placeholder takes the receive
        assert [tuple(t.shape) for t in unpack(buffer, meta)] == [tuple(t.shape) for t in tensors]


def test_a_pytree_payload_carries_its_structure():
    value = {"h": torch.randn(2, 3), "mask": None, "n": 4}
    tensors, structure = flatten(value, "value")
    _, overflow, _, meta, buffer = _packed_round_trip(tensors, structure)
    meta, received = decode_message(meta, unpack(buffer, meta))
    out = unflatten(meta.structure, received)
    assert not overflow and out["mask"] is None and out["n"] == 4 and torch.equal(out["h"], value["h"])


def test_tensors_of_one_payload_are_not_views_each_has_its_own_version_counter():
    h, mask = torch.randn(4, 3), torch.ones(4, 3)
    _, _, _, meta, buffer = _packed_round_trip([h, mask])
    rh, rmask = unpack(buffer, meta)
    assert rh._base is None and rmask._base is None
    assert rh.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # no copy
    w = torch.randn(3, 2, requires_grad=True)
    rh.requires_grad_(True)
    out = torch.sigmoid(rh @ w)  # saves rh and its own output
    rmask.mul_(2)  # an in-place change of another tensor of the message
    out.sum().backward()  # rh's saved version is untouched
    assert torch.equal(rmask, 2 * mask) and torch.equal(rh.detach(), h)


def test_conjugate_and_negative_views_travel_as_their_values():
    z = torch.randn(3, dtype=torch.complex64)
    tensors = [z.conj(), torch.randn(3, dtype=torch.complex64).conj().imag]  # conj bit, neg bit
    expected = [t.resolve_conj().resolve_neg() for t in tensors]
    _, _, _, meta, buffer = _packed_round_trip(tensors)
    for a, b in zip(unpack(buffer, meta), expected):
        assert torch.equal(a, b)


class _Wire:
    """Gloo's matching in one process: a receive posted on a tag takes that tag's next send, in
    the order both were posted; a message longer than the receive's buffer is refused, as Gloo
    refuses it."""

    def __init__(self) -> None:
        tags = (prefetch.HEADER_TAG, prefetch.PAYLOAD_TAG, prefetch.OVERFLOW_TAG)
        self.sent: dict[int, list[Tensor]] = {tag: [] for tag in tags}
        self.posted: list[tuple[int, int]] = []  # (tag, buffer bytes) of each receive, as posted

    def post(self, t, dst, group=None, tag=0):
        self.sent[tag].append(t.clone())
        return _Done()

    def irecv(self, buffer, src, group=None, tag=0):
        index = sum(1 for posted_tag, _ in self.posted if posted_tag == tag)  # matched as it is posted
        self.posted.append((tag, buffer.numel() * buffer.element_size()))
        sent = self.sent[tag]

        class Work:
            def wait(self):
                message = sent[index].reshape(-1).view(torch.uint8)
                assert message.numel() <= buffer.numel() * buffer.element_size(), "longer than the receive"
                buffer.reshape(-1).view(torch.uint8)[: message.numel()] = message

        return Work()

    def taken(self) -> dict[int, int]:
        return {tag: sum(1 for posted_tag, _ in self.posted if posted_tag == tag) for tag in self.sent}


class _Done:
    def wait(self) -> bool:
        return True


def _pair(monkeypatch) -> tuple[_Wire, P2P, P2P]:
    wire = _Wire()
    monkeypatch.setattr(comm.ops, "isend", wire.post)
    monkeypatch.setattr(prefetch.ops, "irecv", wire.irecv)
    sender, receiver = P2P(torch.device("cpu")), P2P(torch.device("cpu"))
    monkeypatch.setattr(sender, "_me", lambda: 0)
    monkeypatch.setattr(receiver, "_me", lambda: 1)
    return wire, sender, receiver


def _send_and_take(sender: P2P, receiver: P2P, messages: list[list[Tensor]], got: list[list[Tensor]]) -> None:
    """``sender`` sends every message to rank 1; ``receiver`` posts and takes them one at a time into
    ``got`` (appended as each arrives), each equal to what was sent, dtypes included."""
    for m in messages:
        sender.send(m, 1)
    for m in messages:
        receiver.post(0)
        got.append(receiver.recv(0)[1])
        assert len(got[-1]) == len(m)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got[-1], m))


def test_receives_posted_ahead_take_messages_whose_size_grows_and_shrinks(monkeypatch):
    """Receives posted up to POSTED_AHEAD messages ahead, each payload's into the room both sides
    derive from the messages before (:class:`prefetch.Rooms`), take every message in order: none is
    ever longer than the receive posted for it, and a payload over its room sends its tensors on a
    tag of their own, which no receive posted ahead takes."""
    wire, sender, receiver = _pair(monkeypatch)
    widths = [4, 40_000, 40_000, 90_000, 10, 90_000, 200_000, 200_000, 200_000, 8, 8]
    messages = [
        [torch.arange(n, dtype=torch.float32), torch.full((3,), float(k))] for k, n in enumerate(widths)
    ]
    for m in messages:
        sender.send(m, 1)
    for _ in range(POSTED_AHEAD + 1):
        receiver.post(0)
    assert receiver.posted(0) == POSTED_AHEAD + 1
    assert wire.posted == [(prefetch.PAYLOAD_TAG, prefetch.HEADER_BYTES + FIRST_ROOM)] * (POSTED_AHEAD + 1)
    with pytest.raises(RuntimeError, match="more than 2 messages ahead"):
        receiver.post(0)  # beyond what the rooms reach
    got = []
    for k in range(len(messages)):
        got.append(receiver.recv(0))  # the oldest posted: in order
        if k + POSTED_AHEAD + 1 < len(messages) and k != 5:
            receiver.post(0)
    for (_, tensors), m in zip(got, messages):
        assert len(tensors) == 2 and all(torch.equal(a, b) for a, b in zip(tensors, m))
    assert wire.taken() == {tag: len(sent) for tag, sent in wire.sent.items()}  # every message taken, once
    assert wire.taken()[prefetch.OVERFLOW_TAG] > 0  # some payloads were over their rooms
    assert max(n for tag, n in wire.posted if tag == prefetch.PAYLOAD_TAG) >= 800_000  # the grown room
    assert wire.taken()[prefetch.HEADER_TAG] > 0  # rooms over FRAMED_ROOM: header and payload apart
    assert receiver.posted(0) == 0


def test_a_frame_that_fills_its_room_is_taken_in_place_after_its_header(monkeypatch):
    """A payload within an eighth of its room is not copied out of its frame: its tensors lie on
    the frame's memory after the header, and read what was sent."""
    wire, sender, receiver = _pair(monkeypatch)
    x = torch.randn(prefetch.FRAMED_ROOM // 4)  # fills the first room
    sender.send([x], 1)
    receiver.post(0)
    (got,) = receiver.recv(0)[1]
    assert torch.equal(got, x) and got.storage_offset() * 4 == prefetch.HEADER_BYTES
    assert wire.taken() == {prefetch.HEADER_TAG: 0, prefetch.PAYLOAD_TAG: 1, prefetch.OVERFLOW_TAG: 0}


def test_a_message_like_the_last_one_taken_is_received_into_a_tensor_of_its_shape(monkeypatch):
    """Where the last message from a source was one tensor filling the next one's room, its payload
    is received into a tensor of that shape and dtype, handed on as it is when the message is alike;
    one that differs (shorter, another dtype, several tensors) still arrives whole."""
    wire, sender, receiver = _pair(monkeypatch)
    big = prefetch.FRAMED_ROOM // 4 * 8  # floats: rooms past FRAMED_ROOM, header and payload apart
    messages = [
        [torch.randn(8, big // 8)],
        [torch.randn(8, big // 8)],
        [torch.randn(8, big // 8)],
        [torch.randn(8, big // 8)],  # received into a float tensor of its shape
        [torch.randn(5, big // 8)],  # shorter
        [torch.randn(8, big // 8)],
        [torch.arange(big, dtype=torch.int32).reshape(8, big // 8)],  # another dtype, the same bytes
        [torch.randn(8, big // 8)],
        [torch.randn(8, big // 8)],
        [torch.randn(4, big // 8), torch.randn(3)],  # several tensors
        [torch.randn(8, big // 8)],
    ]
    unpacked = []
    monkeypatch.setattr(prefetch, "unpack", lambda *a, **k: unpacked.append(len(got)) or unpack(*a, **k))
    got: list[list[Tensor]] = []
    _send_and_take(sender, receiver, messages, got)
    # made over their buffers: the shorter one, each change of dtype, the several tensors and the one after
    assert unpacked == [4, 6, 7, 9, 10]
    sizes = [n for tag, n in wire.posted if tag == prefetch.PAYLOAD_TAG]
    assert sizes[3:] == [4 * big] * (len(messages) - 3)  # past the first rooms: a shorter message fits


@pytest.mark.parametrize(
    "make",
    [
        lambda k: torch.full((prefetch.FRAMED_ROOM // 4 + 1,), float(k)),  # 4 bytes past a multiple of 16
        lambda k: torch.full((prefetch.FRAMED_ROOM // 8 + 1,), float(k), dtype=torch.float64),
        lambda k: torch.arange(prefetch.FRAMED_ROOM + 3) % (k + 2) == 0,  # bool, 3 bytes past
    ],
)
def test_a_payload_whose_bytes_are_not_a_multiple_of_16_arrives_repeatedly(monkeypatch, make):
    """The room counts a payload padded to 16 bytes: a tensor whose own bytes fall short of its
    room is not received into a tensor of its shape, and each repeat arrives whole (none waits
    for an overflow the sender never sends)."""
    wire, sender, receiver = _pair(monkeypatch)
    messages = [[make(k)] for k in range(8)] + [[make(8), torch.arange(3)], [make(9)]]
    _send_and_take(sender, receiver, messages, [])
    assert wire.taken() == {tag: len(sent) for tag, sent in wire.sent.items()}


def test_a_failed_receive_drops_the_receives_still_posted_from_that_source(monkeypatch):
    wire, _, receiver = _pair(monkeypatch)
    receiver.post(3)
    receiver.post(3)
    with pytest.raises(IndexError):  # nothing was sent: the receive fails
        receiver.recv(3)
    assert receiver.posted(3) == 0


def test_a_failed_frame_post_is_raised_by_the_send_and_leaves_only_the_earlier_sends_to_wait_for(
    monkeypatch,
):
    p2p, tags = P2P(torch.device("cpu")), []
    monkeypatch.setattr(p2p, "_me", lambda: 0)
    earlier = threading.Event()
    earlier.set()

    class Earlier:
        def wait(self) -> bool:
            return earlier.wait(5)

    p2p._waiter.put([(Earlier(), torch.zeros(1))])

    def post(t, dst, group, tag):
        tags.append(tag)
        raise RuntimeError("peer gone")

    monkeypatch.setattr(comm.ops, "isend", post)
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.send([torch.randn(2, 2)], 1)
    assert tags == [prefetch.PAYLOAD_TAG]  # one frame, no header apart
    p2p.flush()
    assert p2p.sends_in_flight() == 0
