"""A failure on any rank ends every rank promptly, non-zero, with the original error shown first.

Each job runs under a hard timeout; the harness also waits until every process of the job's
process group (the ranks Lightning's launcher started) has exited.
"""

import json
import time

import pytest

from tests._harness import run_ranks, run_script, traceback_ends

BOUND_S = 60.0


def _run_failing_job(tmp_path, **spec):
    spec = {
        "kind": "mlp",
        "devices": 3,
        "out": str(tmp_path),
        "steps": 5,
        "runs": [{"chunks": 4, "checkpoint": "never"}],
        **spec,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    start = time.monotonic()
    rc, out = run_script("tests/workers/train.py", str(tmp_path / "spec.json"), timeout=150)
    return rc, out, time.monotonic() - start


def _first_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "Error" in line or "[lightning_gpipe]" in line]
    assert lines, out[-3000:]
    return lines[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "where, layer, stage, rank",
    [  # the middle-stage cases take about 20 s each: in the slow set
        pytest.param("forward", 2, 1, 1, marks=pytest.mark.slow),
        pytest.param("backward", 2, 1, 1, marks=pytest.mark.slow),
        ("forward", 4, 2, 0),
    ],
    ids=["middle-stage-forward", "middle-stage-backward", "last-stage-on-launcher-rank"],
)
def test_rank_failure_exits_all_ranks(tmp_path, where, layer, stage, rank):
    """A stage raises on micro-batch 2 of step 3 (its layer's 11th call with chunks 4)."""
    rc, out, seconds = _run_failing_job(tmp_path, fail={"layer": layer, "where": where, "at": 11})
    assert rc != 0
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s to end"
    first = _first_error_line(out)
    assert first.startswith(f"[lightning_gpipe] stage {stage} (rank {rank}) failed"), first
    assert f"failed in {where} of micro-batch 2" in first and f"injected failure in {where} call 11" in first
    # the other ranks say why they stopped, after the original error (when the launching rank fails,
    # it ends the ranks it started at once and they print nothing)
    if rank != 0:
        assert out.index(f"injected failure in {where}") < out.index("stopped because another rank")
    # and each rank that says so names the error
    stopped = [line for line in out.splitlines() if "stopped because another rank" in line]
    assert all(f"injected failure in {where} call 11" in line for line in stopped), stopped
    # the error's traceback once (the report: the original error, then the StageError naming it), and
    # where the error ends the failing rank's process, one line naming the rank
    ends = traceback_ends(out)
    for error in (f"RuntimeError: injected failure in {where} call 11", f"StageError: stage {stage} ("):
        assert sum(end.startswith(error) for end in ends) == 1, ends
    assert f"[lightning_gpipe] stage {stage} (rank {rank}) exits on the StageError reported above" in out


# about 50 s; a rank's failure ending every rank is checked by test_rank_failure_exits_all_ranks
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_failure_while_the_next_messages_are_still_being_received_exits_without_abort(tmp_path):
    """Stage 1 raises on micro-batch 0 of step 2 while the slow stage 0 still has 3 micro-batches to
    send: its receives posted ahead are still pending when the rank exits. Every rank ends
    promptly, the original error first, and none aborts ("terminate called ...", exit code -6)."""
    rc, out, seconds = _run_failing_job(
        tmp_path, fail={"layer": 2, "where": "forward", "at": 5}, slow={"layer": 0, "seconds": 0.5}
    )
    assert rc != 0
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s to end"
    first = _first_error_line(out)
    assert first.startswith("[lightning_gpipe] stage 1 (rank 1) failed"), first
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-3000:]


# about 25 s; the message is checked in process (test_executor.py) and a rank's failure ending every
# rank by the launcher-rank case
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_wrong_shape_between_stages_is_named(tmp_path):
    rc, out, seconds = _run_failing_job(tmp_path, wrong_shape=True)
    assert rc != 0 and seconds < BOUND_S
    first = _first_error_line(out)
    assert (
        "stage 2 (layers 4..4) failed in forward of micro-batch 0 on input from stage 1 "
        "of shape [(3, 17) float32]" in first
    )
    assert "its first layer (Linear) expects (*, 16)" in first


@pytest.mark.timeout(120)
def test_launcher_failure_before_rendezvous_ends_the_started_ranks():
    """Rank 0 fails after starting ranks 1 and 2 but before the process group exists (no connection
    to break yet): the ranks it started are ended at once, not left waiting in the rendezvous."""
    start = time.monotonic()
    rc, out = run_script(
        "tests/workers/rank0_fails_early.py", timeout=90
    )  # waits for the whole process group
    assert rc != 0 and "rank 0 cannot read its data" in out
    assert time.monotonic() - start < BOUND_S


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "hook, rank",
    [
        ("on_train_epoch_end", 1),  # stage 0 fails; the last stage waits at the epoch's metric share
        ("on_validation_epoch_end", 0),  # the last stage fails; stage 0 waits at the validation share
    ],
)
def test_a_failure_in_a_hook_on_one_rank_reaches_the_others_within_seconds_named(tmp_path, hook, rank):
    """A callback's epoch-end hook raises on one rank only (collective_timeout 60 s): the other rank stops
    within seconds with RankFailed naming the failed rank and its error, not blaming the user's code
    at the timeout. Started torchrun-style, so that each rank's own output is read."""
    spec = {
        "kind": "mlp",
        "devices": 2,
        "out": str(tmp_path),
        "steps": 4,
        "val": True,
        "trainer": {"max_epochs": 2, "limit_train_batches": 2, "limit_val_batches": 2},
        "runs": [{"chunks": 2, "collective_timeout": 60}],
        "fail_in": {"hook": hook, "rank": rank},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    start = time.monotonic()
    results = run_ranks("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=150)
    seconds = time.monotonic() - start
    assert seconds < BOUND_S, f"the job took {seconds:.0f} s to end"
    other = 1 - rank
    assert results[rank][0] != 0 and f"ValueError: injected failure in {hook}" in results[rank][1]
    rc, out = results[other]
    stage = {0: 1, 1: 0}[rank]
    assert rc != 0, out[-3000:]
    said = f"but stage {stage} (rank {rank}) failed: ValueError: injected failure in {hook}"
    assert "RankFailed: " in out and said in out, out[-3000:]
    assert "call it on every rank" not in out, out[-3000:]
