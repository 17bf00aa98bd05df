"""Heartbeats name the ranks that are gone: silent without having left, or holding a store that is gone."""

import pytest
import torch.distributed as dist

from lightning_gpipe.transport import liveness
from lightning_gpipe.transport.layout import Layout


@pytest.fixture
def store(monkeypatch):
    """This rank (0 of three stages) reading the heartbeats from an in-memory store."""
    store = dist.HashStore()
    monkeypatch.setattr(liveness, "_state", {"reader": store, "rank": 0})
    monkeypatch.setitem(liveness._names, "layout", Layout(3, 3))
    return store


def test_a_rank_that_stops_beating_without_leaving_is_gone(store):
    for r in (1, 2):
        store.add(f"gpipe/beat/{r}", 3)
    before = liveness.beats([1, 2])
    store.add("gpipe/beat/1", 1)  # rank 1 still beats; rank 2 does not
    assert liveness.gone([1, 2], before) == [2]
    assert (
        liveness.lost([1, 2], before)
        == "rank 2 (stage 0) died or lost its connection (no heartbeat for 2.5 s)"
    )


def test_a_rank_that_left_is_not_gone(store):
    before = liveness.beats([1, 2])
    store.set("gpipe/left/2", "stage 0 (rank 2) failed: ValueError")
    store.add("gpipe/beat/1", 1)
    assert liveness.gone([1, 2], before) == []
    assert liveness.lost([1, 2], before) is None


def test_without_before_it_waits_one_silence(store, monkeypatch):
    monkeypatch.setattr(liveness, "SILENCE_S", 0.01)
    assert liveness.gone([1]) == [1]


class _GoneStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_store_that_cannot_be_reached_names_the_rank_holding_it(store, monkeypatch):
    monkeypatch.setitem(liveness._state, "reader", _GoneStore())
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(liveness.StoreLost, match="held by rank 0's process"):
        liveness.beats([1])
    assert liveness.lost([1], {1: 0}).startswith(
        "rank 0 (stage 2) died or lost its connection (the job's store"
    )
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert liveness.lost([1], {1: 0}).startswith("torchrun's agent died or lost its connection")


def test_no_heartbeat_says_nothing(monkeypatch):
    monkeypatch.setattr(liveness, "_state", {})
    assert liveness.beats([1]) is None and liveness.gone([1]) is None and liveness.lost([1]) is None
    liveness.leave("nothing to tell")  # no store: nothing happens


def test_a_rank_found_gone_stays_gone(store):
    before = liveness.beats([1, 2])
    store.add("gpipe/beat/1", 1)
    said = liveness.lost([1, 2], before)
    assert liveness.known_lost([2, 5]) == said and liveness.known_lost([1]) is None


def test_departed_gives_each_leaving_rank_its_reason(store):
    store.set("gpipe/left/2", "stage 0 (rank 2) failed: ValueError: boom")
    assert liveness.departed([1, 2]) == {2: "stage 0 (rank 2) failed: ValueError: boom"}
    assert liveness.departed([1]) == {}


def test_a_ranks_first_reason_for_leaving_stands(store):
    """A failed rank's reason is what the others read, even once it has exited (said again at exit):
    a rank that learns of the failure late, through a third rank, names the error."""
    liveness.leave("stage 2 (rank 0) failed: ValueError: boom")
    liveness.leave("exited")
    assert liveness.departed([0]) == {0: "stage 2 (rank 0) failed: ValueError: boom"}


def test_departed_without_heartbeat_or_store_says_nothing(store, monkeypatch):
    monkeypatch.setitem(liveness._state, "reader", _GoneStore())
    assert liveness.departed([1]) == {}
    monkeypatch.setattr(liveness, "_state", {})
    assert liveness.departed([1]) == {}
