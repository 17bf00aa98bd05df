"""The send waiter: buffers dropped as sends complete, one lingering thread, errors kept for the stage."""

import threading
import time

import pytest
import torch

from lightning_gpipe.transport import send_waiter as waiting
from lightning_gpipe.transport.send_waiter import SendWaiter
from tests.fakes import FakeSend


def test_the_send_waiter_drops_buffers_as_sends_complete_and_one_thread_serves_every_phase(monkeypatch):
    monkeypatch.setattr(waiting, "LINGER_S", 30.0)
    waiter = SendWaiter()
    threads = []
    for _ in range(2):  # two phases, each ended by close() (P2P.flush)
        works = [FakeSend(), FakeSend()]
        for w in works:
            waiter.put([(w, torch.zeros(1))])
        threads.append(waiter._thread)
        assert waiter.held == 2 and not waiting.join_sends(0.05)  # busy: sends in hand
        works[0].done.set()
        deadline = time.monotonic() + 10
        while waiter.held != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waiter.held == 1  # the first buffer went as its send completed
        works[1].done.set()
        waiter.close()
        assert waiter.held == 0 and waiting.join_sends(1.0)  # idle: nothing in hand
    assert threads[0] is threads[1] and threads[0].is_alive()  # no thread started for the second phase


def test_an_idle_background_thread_ends_after_lingering(monkeypatch):
    monkeypatch.setattr(waiting, "LINGER_S", 0.05)
    waiter = SendWaiter()
    work = FakeSend()
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
    waiter = SendWaiter()
    monkeypatch.setattr(
        threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("no thread"))
    )
    with pytest.raises(RuntimeError, match="no thread"):
        waiter.put([(FakeSend(), torch.zeros(1))])
    assert waiter.held == 0 and waiter._thread is None and waiting.join_sends(0.5)
    waiter.close()  # returns at once: nothing was put


def test_a_message_put_as_the_idle_thread_ends_is_still_waited_for(monkeypatch):
    """The idle thread ends only with nothing in its queue, and a put starts a thread where none runs:
    with the thread ending between most puts, every message is still dropped and close returns."""
    monkeypatch.setattr(waiting, "LINGER_S", 0.0005)
    waiter, threads = SendWaiter(), set()
    for k in range(300):
        work = FakeSend()
        work.done.set()
        waiter.put([(work, torch.zeros(1))])
        threads.add(waiter._thread)
        if k % 3:
            time.sleep(0.001)
    closing = threading.Thread(target=waiter.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive() and waiter.held == 0
    assert len(threads) > 10  # the thread ended and started again many times


def test_close_returns_when_the_thread_ends_between_its_count_and_its_marker(monkeypatch):
    """close() reads the messages in hand, then queues its marker: where the thread drops them, idles
    and ends in between, close finds no thread and returns instead of waiting for a marker no one takes."""
    monkeypatch.setattr(waiting, "LINGER_S", 0.01)
    waiter, work = SendWaiter(), FakeSend()
    waiter.put([(work, torch.zeros(1))])
    thread = waiter._thread
    count = type(waiter).held
    calls = []

    def held(self):  # the count close() reads, then the thread ends before the marker is queued
        calls.append(1)
        value = count.fget(self)
        work.done.set()
        thread.join(5)
        return value

    monkeypatch.setattr(SendWaiter, "held", property(held))
    closing = threading.Thread(target=waiter.close, daemon=True)
    closing.start()
    closing.join(10)
    assert calls and not thread.is_alive() and not closing.is_alive()
