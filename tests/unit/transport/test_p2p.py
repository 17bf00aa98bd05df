"""Point-to-point transport: announced messages posted ahead and taken in order, rooms, lanes, the send waiter, errors handed on."""

import threading
import time

import pytest
import torch
from torch import Tensor

from lightning_gpipe.transport import p2p as comm
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.wire import decode_header, decode_message, unpack


def test_lanes_route_by_direction_within_the_pipeline_only():
    up, down = object(), object()
    lanes = comm.Lanes(frozenset({4, 5, 6}), up, down)
    assert lanes.group(4, 6) is up and lanes.group(5, 6) is up
    assert lanes.group(6, 4) is down and lanes.group(5, 4) is down
    assert lanes.group(4, 7) is None and lanes.group(0, 5) is None
    lanes.close()
    assert lanes.group(4, 6) is None and lanes.upward is None  # closed: the default group


class _Wire:
    """Gloo's matching in one process: a receive posted on a tag takes that tag's next send, in
    the order both were posted; a message longer than the receive's buffer is refused, as Gloo refuses it."""

    def __init__(self) -> None:
        self.sent: dict[int, list[Tensor]] = {
            comm.HEADER_TAG: [],
            comm.PAYLOAD_TAG: [],
            comm.OVERFLOW_TAG: [],
        }
        self.posted: list[tuple[int, int]] = []  # (tag, buffer bytes) of each receive, as posted

    def post(self, t, dst, group=None, tag=0):
        self.sent[tag].append(t.clone())
        return _done()

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


def test_receives_posted_ahead_take_messages_whose_size_grows_and_shrinks(monkeypatch):
    """Announced receives are posted ahead, each payload's into the room both sides derive from the
    messages before (:class:`comm._Rooms`): no message is ever longer than the receive posted for
    it, and a payload over its room sends its tensors on a tag of their own, which no receive posted
    ahead takes."""
    wire = _Wire()
    monkeypatch.setattr(comm, "_post", wire.post)
    monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
    sender, receiver = P2P(torch.device("cpu")), P2P(torch.device("cpu"))
    monkeypatch.setattr(receiver, "_me", lambda: 1)
    widths = [4, 40_000, 40_000, 90_000, 10, 90_000, 200_000, 200_000, 200_000, 8, 8]
    messages = [
        [torch.arange(n, dtype=torch.float32), torch.full((3,), float(k))] for k, n in enumerate(widths)
    ]
    for m in messages:
        sender.send(m, 1)
    receiver.expect(0, 6)
    assert wire.posted == [(comm.PAYLOAD_TAG, comm.HEADER_BYTES + comm.FIRST_ROOM)] * (
        comm.AHEAD + 1
    )  # at the announcement: rooms of FIRST_ROOM, each message one frame
    got = [receiver.recv(0) for _ in range(6)]
    receiver.expect(0, 5)
    got += [receiver.recv(0) for _ in range(5)]
    for (_, tensors), m in zip(got, messages):
        assert all(torch.equal(a, b) for a, b in zip(tensors, m)) and len(tensors) == 2
    assert wire.taken() == {tag: len(sent) for tag, sent in wire.sent.items()}  # every message taken, once
    assert wire.taken()[comm.OVERFLOW_TAG] > 0  # some payloads were over their rooms
    assert max(n for tag, n in wire.posted if tag == comm.PAYLOAD_TAG) >= 800_000  # the grown room
    assert wire.taken()[comm.HEADER_TAG] > 0  # rooms over FRAMED_ROOM: header and payload apart
    assert len(wire.sent[comm.HEADER_TAG]) == sum(  # one header apart per message in a larger room
        n > comm.HEADER_BYTES + comm.FRAMED_ROOM  # (a frame's receive is at most this long)
        for tag, n in wire.posted
        if tag == comm.PAYLOAD_TAG
    )


def test_a_frame_that_fills_its_room_is_taken_in_place_after_its_header(monkeypatch):
    """A payload within an eighth of its room is not copied out of its frame: its tensors lie on
    the frame's memory after the header, and read what was sent."""
    wire = _Wire()
    monkeypatch.setattr(comm, "_post", wire.post)
    monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
    sender, receiver = P2P(torch.device("cpu")), P2P(torch.device("cpu"))
    monkeypatch.setattr(receiver, "_me", lambda: 1)
    x = torch.randn(comm.FRAMED_ROOM // 4)  # fills the first room
    sender.send([x], 1)
    receiver.expect(0, 1)
    (got,) = receiver.recv(0)[1]
    assert torch.equal(got, x) and got.storage_offset() * 4 == comm.HEADER_BYTES  # in place, after the header
    assert wire.taken() == {comm.HEADER_TAG: 0, comm.PAYLOAD_TAG: 1, comm.OVERFLOW_TAG: 0}


def test_announcing_twice_before_taking_everything_is_an_error(monkeypatch):
    wire = _Wire()
    monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
    p2p = P2P(torch.device("cpu"))
    p2p.expect(3, 2)
    with pytest.raises(RuntimeError, match="from rank 3 are still to be received"):
        p2p.expect(3, 2)
    with pytest.raises(IndexError):  # nothing was sent: the receive fails, and the announcement is dropped
        p2p.recv(3)
    monkeypatch.setattr(comm.dist, "irecv", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("peer gone")))
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.expect(3, 1)  # posting fails at the announcement: it is dropped too
    monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
    p2p.expect(3, 1)  # the next one is taken afresh
    assert P2P(torch.device("cuda")).background is False  # CUDA receives are posted when needed
    P2P(torch.device("cuda")).expect(3, 2)  # and announcing is then a no-op


class _Send:
    """A send's work that completes when ``done`` is set (raising ``error``, if set)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        completed = self.done.wait(10)
        if self.error is not None:
            raise self.error
        return completed


def test_the_send_waiter_drops_buffers_as_sends_complete_and_one_thread_serves_every_phase(monkeypatch):
    monkeypatch.setattr(comm, "LINGER_S", 30.0)
    waiter = comm._SendWaiter()
    threads = []
    for _ in range(2):  # two phases, each ended by close() (P2P.flush)
        works = [_Send(), _Send()]
        for w in works:
            waiter.put([(w, torch.zeros(1))])
        threads.append(waiter._thread)
        assert waiter.held == 2 and not comm.join_sends(0.05)  # busy: sends in hand
        works[0].done.set()
        deadline = time.monotonic() + 10
        while waiter.held != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waiter.held == 1  # the first buffer went as its send completed
        works[1].done.set()
        waiter.close()
        assert waiter.held == 0 and comm.join_sends(1.0)  # idle: nothing in hand
    assert threads[0] is threads[1] and threads[0].is_alive()  # no thread started for the second phase


def test_an_idle_background_thread_ends_after_lingering(monkeypatch):
    monkeypatch.setattr(comm, "LINGER_S", 0.05)
    waiter = comm._SendWaiter()
    work = _Send()
    work.done.set()
    waiter.put([(work, torch.zeros(1))])
    thread = waiter._thread
    waiter.close()
    thread.join(5)
    assert not thread.is_alive() and waiter._thread is None
    waiter.put([(work, torch.zeros(1))])  # work after the end starts a thread again
    waiter.close()
    assert waiter.held == 0


def test_a_thread_that_cannot_start_leaves_nothing_held_and_nothing_to_wait_for(monkeypatch):
    waiter = comm._SendWaiter()
    monkeypatch.setattr(
        threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("no thread"))
    )
    with pytest.raises(RuntimeError, match="no thread"):
        waiter.put([(_Send(), torch.zeros(1))])
    assert waiter.held == 0 and waiter._thread is None and comm.join_sends(0.5)
    waiter.close()  # returns at once: nothing was put


@pytest.mark.parametrize("fails", [comm.HEADER_TAG, comm.PAYLOAD_TAG])
def test_a_failed_post_is_raised_by_the_send_and_flush_still_waits_for_the_earlier_sends(monkeypatch, fails):
    """A post that fails is raised by the send; what was posted before it (the earlier messages, and
    the message's header where its payload's post failed) is still waited for by the flush."""
    p2p = P2P(torch.device("cpu"))
    monkeypatch.setattr(comm, "FRAMED_ROOM", 0)  # header and payload apart
    earlier, header = _Send(), _Send()
    p2p._waiter.put([(earlier, torch.zeros(1))])

    def post(t, dst, group, tag):
        if tag == fails:
            raise RuntimeError("peer gone")
        return header

    monkeypatch.setattr(comm, "_post", post)
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.send([torch.randn(2, 2)], 1)  # posted in the calling thread
    assert p2p.sends_in_flight() == 1 + (fails == comm.PAYLOAD_TAG)
    threading.Timer(0.2, earlier.done.set).start()
    threading.Timer(0.3, header.done.set).start()
    p2p.flush()  # waits for the earlier sends
    assert earlier.done.is_set() and p2p.sends_in_flight() == 0
    assert header.waited == (fails == comm.PAYLOAD_TAG)


def test_a_message_that_cannot_travel_is_refused_by_the_send_itself(monkeypatch):
    """Encoded, packed and posted in the stage's thread: under a per-micro-batch schedule the stage may not flush before its peer waits for the message,
    so an error held until then would leave the peer waiting for the process group's timeout."""
    p2p, posted = P2P(torch.device("cpu")), []
    monkeypatch.setattr(comm, "_post", lambda t, dst, group, tag: posted.append(t.clone()) or _done())
    with pytest.raises(ValueError, match="cannot send a tensor of dtype torch.uint16"):
        p2p.send([torch.zeros(2, dtype=torch.uint16)], 1)
    p2p.send([torch.ones(3)], 1)
    p2p.flush()
    assert len(posted) == 1  # the good message still travels: one frame, its header then its payload
    (frame,) = posted
    assert frame.numel() == comm.HEADER_BYTES + 12  # one tensor's bytes, as they are
    meta = decode_header(frame[: comm.HEADER_BYTES].view(torch.int64))
    meta, (received,) = decode_message(meta, unpack(frame[comm.HEADER_BYTES :], meta))
    assert torch.equal(received, torch.ones(3)) and meta.chunks == 0


def test_a_failed_frame_post_is_raised_by_the_send_and_leaves_only_the_earlier_sends_to_wait_for(monkeypatch):
    p2p, earlier = P2P(torch.device("cpu")), _done()
    p2p._waiter.put([(earlier, torch.zeros(1))])
    tags = []

    def post(t, dst, group, tag):
        tags.append(tag)
        raise RuntimeError("peer gone")

    monkeypatch.setattr(comm, "_post", post)
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.send([torch.randn(2, 2)], 1)
    assert tags == [comm.PAYLOAD_TAG]  # one frame, no header apart
    p2p.flush()
    assert p2p.sends_in_flight() == 0


def test_a_failed_background_send_is_raised_by_settle_before_the_flush():
    """A stage that sends as it goes (1F1B) settles after every action and flushes only at the end
    of its column: a send whose wait failed in the waiter thread is raised at the next settle, the
    sends after it are dropped unwaited, and the flush raises it too."""
    p2p = P2P(torch.device("cpu"))
    failed, later = _Send(), _Send()
    failed.error = RuntimeError("peer gone")
    p2p._waiter.put([(failed, torch.zeros(1))])
    p2p._waiter.put([(later, torch.zeros(1))])
    failed.done.set()
    deadline = time.monotonic() + 10
    while p2p._waiter._error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.settle()
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.flush()
    assert p2p.sends_in_flight() == 0 and not later.waited
    p2p.settle()  # the flush took the error: the transport is usable again


def _done() -> _Send:
    work = _Send()
    work.done.set()
    return work
