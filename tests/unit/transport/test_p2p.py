"""Point-to-point transport: messages received in order (on CUDA, as a header then each tensor; on
CPU as :mod:`lightning_gpipe.transport.prefetch` lays them out, tested there), lanes, the send
waiter, errors handed on."""

import threading
import time
import weakref

import pytest
import torch
from torch import Tensor

from lightning_gpipe.transport import p2p as comm
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.wire import decode_header, decode_message
from tests.fakes import FakeSend


def test_lanes_route_by_direction_within_the_pipeline_only():
    up, down = object(), object()
    lanes = comm.Lanes(frozenset({4, 5, 6}), up, down)
    assert lanes.group(4, 6) is up and lanes.group(5, 6) is up
    assert lanes.group(6, 4) is down and lanes.group(5, 4) is down
    assert lanes.group(4, 7) is None and lanes.group(0, 5) is None
    lanes.close()
    assert lanes.group(4, 6) is None and lanes.upward is None  # closed: the default group


class _Wire:
    """Point-to-point in one process: a receive takes the oldest send from its source (Gloo's order
    per pair and tag); the buffer must have the sent size, as Gloo and NCCL require."""

    def __init__(self) -> None:
        self.sent: list[Tensor] = []
        self.received: list[int] = []  # bytes of each receive, as posted

    def isend(self, t, dst, group=None, tag=0):
        self.sent.append(t.clone())
        return _done()

    def irecv(self, t, src, group=None, tag=0):
        message = self.sent.pop(0)
        assert message.shape == t.shape and message.dtype == t.dtype, (message.shape, t.shape)
        t.copy_(message)
        self.received.append(t.numel() * t.element_size())
        return _done()


def _unpacked(**options) -> P2P:
    """A transport laid out as on CUDA (NCCL): no payload packing, nothing posted ahead."""
    p2p = P2P(torch.device("cpu"), **options)
    p2p.packed = False
    return p2p


def test_a_message_is_its_header_then_each_tensor_received_on_demand_on_cuda(monkeypatch):
    """Each value travels as its header and then its tensors (a pytree's structure last), received
    when the stage asks, in order, whatever their sizes, dtypes and shapes; posting ahead does
    nothing."""
    wire = _Wire()
    monkeypatch.setattr(comm.ops, "isend", lambda t, dst, group=None, tag=0: wire.isend(t, dst))
    monkeypatch.setattr(comm.ops, "irecv", wire.irecv)
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 0)
    p2p = _unpacked(background=False)
    p2p.post(1)
    assert p2p.posted(1) == 0 and not wire.received
    assert P2P(torch.device("cuda")).packed is False
    values = [
        [torch.randn(4, 3)],
        [torch.randn(400, 500), torch.arange(7)],
        [torch.randn(2, 2).bfloat16()],
        [torch.randn(6)],
    ]
    for k, v in enumerate(values):
        p2p.send(v, 1, chunks=k)
    assert len(wire.sent) == sum(1 + len(v) for v in values)  # a header and each tensor
    for k, v in enumerate(values):
        meta, got = p2p.recv(1)
        assert meta.chunks == k and len(got) == len(v)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, v))
    assert wire.sent == [] and wire.received[0] == comm.HEADER_SLOTS * 8
    p2p.flush()


@pytest.mark.parametrize("fails", [0, 1])
def test_a_failed_post_is_raised_by_the_send_and_flush_still_waits_for_the_earlier_sends(monkeypatch, fails):
    """A post that fails is raised by the send; what was posted before it (the earlier messages, and
    the message's header where its tensor's post failed) is still waited for by the flush."""
    p2p = _unpacked()
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 0)
    earlier, header = FakeSend(), FakeSend()
    p2p._waiter.put([(earlier, torch.zeros(1))])
    posts = []

    def post(t, dst, group, tag=0):
        posts.append(t)
        if len(posts) - 1 == fails:
            raise RuntimeError("peer gone")
        return header

    monkeypatch.setattr(comm.ops, "isend", post)
    with pytest.raises(RuntimeError, match="peer gone"):
        p2p.send([torch.randn(2, 2)], 1)  # posted in the calling thread
    assert p2p.sends_in_flight() == 1 + (fails == 1)
    threading.Timer(0.2, earlier.done.set).start()
    threading.Timer(0.3, header.done.set).start()
    p2p.flush()  # waits for the earlier sends
    assert earlier.done.is_set() and p2p.sends_in_flight() == 0
    assert header.waited == (fails == 1)


def test_a_message_that_cannot_travel_is_refused_by_the_send_itself(monkeypatch):
    """Encoded and posted in the stage's thread: under a per-micro-batch schedule the stage may not
    flush before its peer waits for the message, so an error held until then would leave the peer
    waiting for the process group's timeout."""
    p2p, posted = _unpacked(), []
    monkeypatch.setattr(comm.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(comm.ops, "isend", lambda t, dst, group, tag=0: posted.append(t.clone()) or _done())
    with pytest.raises(ValueError, match="cannot send a tensor of dtype torch.uint16"):
        p2p.send([torch.zeros(2, dtype=torch.uint16)], 1)
    p2p.send([torch.ones(3)], 1)
    p2p.flush()
    assert len(posted) == 2  # the good message still travels: its header, then its tensor as it is
    header, tensor = posted
    meta, (received,) = decode_message(decode_header(header), [tensor])
    assert torch.equal(received, torch.ones(3)) and meta.chunks == 0


def test_a_failed_background_send_is_raised_by_settle_before_the_flush():
    """A stage that sends as it goes (1F1B) settles after every action and flushes only at the end
    of its column: a send whose wait failed in the waiter thread is raised at the next settle, the
    sends after it are dropped unwaited, and the flush raises it too."""
    p2p = P2P(torch.device("cpu"))
    failed, later = FakeSend(), FakeSend()
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


def _done() -> FakeSend:
    work = FakeSend()
    work.done.set()
    return work


def test_closing_the_lanes_lets_go_of_every_receive_posted_ahead(monkeypatch):
    """After a failure (``failure.abort_process_group``) and at exit, the receives a stage posted ahead
    and never took are dropped with the lanes: each holds its group's connection open, and a peer
    whose sends wait for that connection to close would wait until it is killed (a last stage failing
    under ``"gpipe"`` with more of the step's forwards still to come than it posted: 38 s, the
    launcher's ``signal_grace``, before; about 3 s after)."""
    p2p = P2P(torch.device("cpu"))
    monkeypatch.setattr(p2p, "_me", lambda: 0)
    held = []

    def irecv(t, src, group=None, tag=0):
        work = FakeSend()
        held.append(weakref.ref(work))
        return work

    monkeypatch.setattr(comm.ops, "irecv", irecv)
    for _ in range(3):
        p2p.post(1)
    assert p2p.posted(1) == 3 and all(ref() is not None for ref in held)
    comm.release_connections()
    assert p2p.posted(1) == 0 and all(ref() is None for ref in held)  # nothing holds their works
