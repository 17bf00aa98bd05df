"""A rank waiting at an operation that needs every rank names a missing rank that failed with an error
of its own at once, rather than blaming the user's code at the timeout."""

import time

import pytest
import torch.distributed as dist

from lightning_gpipe.errors import CollectiveTimeout, RankFailed
from lightning_gpipe.transport import arrival, failure, liveness
from lightning_gpipe.transport.layout import Layout


@pytest.fixture
def store(monkeypatch):
    """Rank 0 of two (two stages), its collectives' store and its heartbeat reader one in-memory store."""
    store = dist.HashStore()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(arrival, "_store", lambda: store)
    monkeypatch.setattr(liveness, "_state", {"reader": store, "rank": 0})
    monkeypatch.setitem(liveness._names, "layout", Layout(2, 2))
    arrival.reset()
    return store


def test_a_missing_rank_that_failed_is_named_with_its_error_within_a_second(store):
    store.set("gpipe/left/1", "stage 0 (rank 1) failed: ValueError: boom in on_train_epoch_end")
    start = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        arrival.arrive("sharing epoch metrics over pipeline 0", timeout=30.0)
    assert time.monotonic() - start < 1.0
    assert str(caught.value).startswith(
        "sharing epoch metrics over pipeline 0 needs every rank, but stage 0 (rank 1) failed: "
        "ValueError: boom in on_train_epoch_end (rank 0 waited for it"
    )
    assert "call it on every rank" not in str(caught.value)
    assert arrival.failure_note() == str(caught.value)  # for the other ranks' reports


def test_a_rank_that_arrived_before_it_left_is_not_waited_for(store):
    store.set("gpipe/arrive/barrier/1/1", "1")
    store.set("gpipe/left/1", "stage 0 (rank 1) failed: ValueError: later")
    arrival.arrive("barrier", timeout=30.0)  # returns: rank 1 came


def test_a_missing_rank_that_is_alive_is_blamed_at_the_timeout(store, monkeypatch):
    monkeypatch.setattr(liveness, "_state", {})  # no heartbeat: only the timeout
    with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[1\] did not reach it within 0.3 s"):
        arrival.arrive("barrier", timeout=0.3)


def test_a_rank_whose_connection_broke_names_the_rank_that_failed_and_its_error(store, monkeypatch):
    monkeypatch.setattr(failure, "abort_process_group", lambda: None)
    monkeypatch.setattr(failure, "_other_ranks", lambda: [1])
    store.set("gpipe/left/1", "stage 0 (rank 1) failed: KeyError: 'x'")
    broken = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    start = time.monotonic()
    failure.report_and_abort(broken, "stage 1 (rank 0)")
    assert time.monotonic() - start < 1.0  # no wait for heartbeats: the rank said why it left
    assert str(broken).startswith(
        "[lightning_gpipe] stage 1 (rank 0) stopped because another rank of the job failed (stage 0 "
        "(rank 1) failed: KeyError: 'x'; its report is printed"
    )


def test_an_operation_over_a_rank_set_is_numbered_apart_from_the_same_operation_over_all_ranks(store):
    """A fit of another layout in the same processes places a rank in other subsets: each set keeps its own
    count, so the second call over ranks [0, 1] is that set's first (rank 1's key 1), not the job's second."""
    store.set("gpipe/arrive/share/1/1", "1")
    arrival.arrive("share", timeout=30.0)
    store.set("gpipe/arrive/share [0,1]/1/1", "1")
    arrival.arrive("share", timeout=30.0, ranks=[1, 0])  # returns: rank 1 came to this set's first
    assert store.check(["gpipe/arrive/share [0,1]/1/0"])
