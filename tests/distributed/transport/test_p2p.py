"""Point-to-point transport across processes: messages in order, a peer gone, lanes per direction."""

import json

import pytest
import torch

from tests._harness import check, run_ranks


@pytest.mark.timeout(120)
def test_messages_arrive_in_order_with_their_shapes_and_dtypes(tmp_path):
    for result in run_ranks("tests/workers/p2p.py", 2, str(tmp_path), "order", timeout=100):
        check(result)
    sent = torch.load(tmp_path / "sent.pt")
    received = torch.load(tmp_path / "received.pt")
    assert [count for count, _ in received] == list(range(8))
    for ours, theirs in zip(received, sent):
        tensors = ours[1]
        assert len(tensors) == len(theirs)
        for a, b in zip(tensors, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # a send's buffer is dropped once the peer has it, not at the step's flush (1F1B's memory)
    held = json.loads((tmp_path / "held.json").read_text())
    assert held["posted"] <= 4 and held["held_once_received"] == 0, held


def _receive_error(tmp_path, mode):
    """The worker's ``mode`` on 2 ranks: rank 1's receive must raise a RuntimeError; its report."""
    for result in run_ranks("tests/workers/p2p.py", 2, str(tmp_path), mode, timeout=100):
        check(result)
    report = json.loads((tmp_path / "error.json").read_text())
    assert report["error"] is not None and "RuntimeError" in report["error"], report
    return report


@pytest.mark.timeout(120)
def test_a_receive_from_a_peer_that_exited_raises_in_the_stage(tmp_path):
    """The sender leaves after 1 message: the next recv raises promptly, never hangs."""
    assert _receive_error(tmp_path, "peer_exits")["seconds"] < 30


@pytest.mark.timeout(120)
def test_each_direction_of_a_pipeline_travels_on_its_own_lane_and_other_pairs_on_the_default_group(tmp_path):
    """Two pipelines of two stages (4 ranks): each pair sends both ways at once, rank 0 sends rank 2."""
    for result in run_ranks("tests/workers/p2p.py", 4, str(tmp_path), "lanes", timeout=100):
        check(result)
    used = [json.loads((tmp_path / f"lanes{r}.json").read_text()) for r in range(4)]
    assert all(u["equal"] for u in used)
    for lower, higher in ((0, 1), (2, 3)):  # each pipeline: up from its lower rank, down from its higher
        # 3 messages each way, each one frame (small: its header and its payload together)
        assert used[lower]["posts"][:3] == ["upward"] * 3 and used[lower]["receives"][:3] == ["downward"] * 3
        assert used[higher]["posts"] == ["downward"] * 3 and used[higher]["receives"] == ["upward"] * 3
    assert used[0]["posts"][3:] == ["default"]  # rank 2 is in another pipeline
    assert used[2]["receives"][3:] == ["default"]


@pytest.mark.timeout(120)
def test_a_rank_that_aborts_after_a_failure_closes_its_lanes_at_once(tmp_path):
    """Its peer, waiting on their lane, fails within seconds, not when the aborted rank exits (12 s later
    unless the peer has failed by then)."""
    report = _receive_error(tmp_path, "lanes_abort")
    assert report["seconds"] < 8, report
