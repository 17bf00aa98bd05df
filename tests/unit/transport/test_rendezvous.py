"""A later entry call of a job waits for every rank, keeps an intact connection, and fails at once,
saying the process cannot train again, for a rank that will never come (issue 40)."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_gpipe.transport import liveness, rendezvous


@pytest.fixture
def job(monkeypatch):
    """A job of 2 ranks seen from rank 0, its store in this process; ``_job`` is the module's record."""
    store = dist.HashStore()
    record = {"store": store, "generation": 0, "excepthook": None}
    monkeypatch.setattr(rendezvous, "_job", record)
    monkeypatch.setattr(liveness, "beats", lambda ranks, count_left=False: None)  # no heartbeat here
    return store, record


@pytest.mark.parametrize("peer_intact, expected", [("1", True), ("0", False)])
def test_gather_keeps_the_connection_only_when_every_rank_has_it(job, peer_intact, expected):
    store, record = job
    store.set("gpipe/connect/1/1", peer_intact)  # rank 1 arrived first
    assert rendezvous.gather(0, 2, timedelta(seconds=5), intact=True) is expected
    assert store.get("gpipe/connect/1/0") == b"1"
    store.set("gpipe/connect/2/1", "1")  # the next entry call has keys of its own
    assert rendezvous.gather(0, 2, timedelta(seconds=5), intact=False) is False
    assert record["connects"] == 2


def test_a_started_rank_that_exited_fails_at_once(job):
    rendezvous.watch(lambda: "the ranks this process started have exited: local rank 1 (pid 7, exit code 1)")
    start = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous.gather(0, 2, timedelta(seconds=60), intact=True)
    assert time.monotonic() - start < 5
    assert "local rank 1 (pid 7, exit code 1)" in str(err.value)
    assert "this process cannot train with them again" in str(err.value)
    with pytest.raises(rendezvous.RendezvousError, match="local rank 1"):  # before the first connection too
        rendezvous.check_started()


def test_a_rank_whose_heartbeat_stopped_fails_within_the_silence(job, monkeypatch):
    monkeypatch.setattr(liveness, "SILENCE_S", 0.2)
    monkeypatch.setattr(liveness, "beats", lambda ranks, count_left=False: {r: 7 for r in ranks})
    with pytest.raises(rendezvous.RendezvousError, match=r"rank 1\b.*stopped beating .* it exited or died"):
        rendezvous.gather(0, 2, timedelta(seconds=60), intact=True)


def test_a_rank_that_never_arrives_fails_at_the_timeout(job):
    with pytest.raises(rendezvous.RendezvousError, match=r"rank\(s\) \[1\] did not reach it within 0.2 s"):
        rendezvous.gather(0, 2, timedelta(seconds=0.2), intact=True)


def test_a_started_rank_that_arrived_then_exited_fails_at_once(job):
    """Lightning's Ctrl-C path: the started rank reached the next call, then the launching process
    ended it; a process group would wait for it forever."""
    store, _ = job
    store.set("gpipe/connect/1/1", "1")
    rendezvous.watch(lambda: "the ranks this process started have exited: local rank 1 (pid 7, exit code -9)")
    with pytest.raises(rendezvous.RendezvousError, match="exit code -9"):
        rendezvous.gather(0, 2, timedelta(seconds=60), intact=False)
