"""A collective reached by only some ranks fails within collective_timeout on every rank, naming the
operation and the missing ranks; SIGTERM and SIGINT end every rank within seconds even while one is
blocked."""

import json
import time

import pytest

from tests._harness import run_ranks, run_script


def _spec(tmp_path, **extra):
    spec = {"kind": "mlp", "devices": 2, "out": str(tmp_path), "steps": 5, **extra}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return str(tmp_path / "spec.json")


_OPERATIONS = {  # what the worker's Rank0Only callback calls -> the operation its error names
    "save": "gathering the model's state (save_checkpoint)",
    "barrier": "barrier 'only rank 0'",
    "broadcast": "broadcast",
    "agree": "reduce_boolean_decision",
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("launch", "call"),
    [
        ("lightning", "save"),
        pytest.param(
            "torchrun", "save", marks=pytest.mark.slow
        ),  # save: the lightning case; torchrun: barrier
        ("torchrun", "barrier"),
        pytest.param("torchrun", "broadcast", marks=pytest.mark.slow),  # the suite's time: 12 s each
        pytest.param("torchrun", "agree", marks=pytest.mark.slow),
    ],
)
def test_collective_reached_only_on_global_zero_fails_fast_on_every_rank(tmp_path, launch, call):
    """A callback guarded by trainer.is_global_zero saves a checkpoint, enters a barrier, broadcasts or
    calls reduce_boolean_decision: with collective_timeout=5 every rank exits non-zero within a minute, and
    the error names the operation and the rank that did not come. Under Lightning's launcher rank 0 ends
    the ranks it started (one output); started torchrun-style, each rank prints the error itself."""
    path = _spec(tmp_path, runs=[{"chunks": 2, "collective_timeout": 5}], rank0_only={"at": 1, "call": call})
    note = f"{_OPERATIONS[call]} needs every rank, but rank(s) [1] did not reach it within 5 s"
    start = time.monotonic()
    if launch == "lightning":
        results = [run_script("tests/workers/train.py", path, timeout=150)]
    else:
        results = run_ranks("tests/workers/train.py", 2, path, timeout=150)
    seconds = time.monotonic() - start  # run_job returns once every process of the job has ended
    assert seconds < 60, f"the job took {seconds:.0f} s to end"
    for rank, (rc, out) in enumerate(results):
        assert rc != 0, f"rank {rank}:\n{out[-3000:]}"
        assert note in out, f"rank {rank}:\n{out[-3000:]}"
        assert "worker rank" not in out  # no rank finished normally
    if launch == "torchrun":  # the rank that did not come learns why from the one that timed out
        assert "stage 0 (rank 1) stopped because another rank of the job failed (" + note in results[1][1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "signal",
    ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)],  # the suite's time: 20 s each
)
def test_signal_ends_every_rank_while_one_is_blocked_in_a_collective(tmp_path, signal):
    """Rank 0 alone enters a barrier (collective_timeout 600 s, so it stays blocked) and gets SIGTERM, or
    SIGINT as from Ctrl-C, 2 s later: the step boundary never comes, so both ranks end within seconds of
    signal_grace (3 s), non-zero."""
    what = {"at": 1, "call": "barrier", "sigterm_after": 2, "signal": signal}
    run = {"chunks": 2, "collective_timeout": 600, "signal_grace": 3}
    path = _spec(tmp_path, runs=[run], rank0_only=what)
    rc, out = run_script("tests/workers/train.py", path, timeout=100)
    seconds = time.time() - (tmp_path / "blocked").stat().st_mtime
    assert rc != 0
    assert seconds < 20, f"the ranks took {seconds:.0f} s to end after {signal}:\n{out[-3000:]}"
    assert f"got {signal}" in out
    assert "worker rank" not in out  # no rank finished normally


@pytest.mark.timeout(120)
def test_the_sigterm_check_stops_every_rank_at_the_same_step_without_waiting(tmp_path):
    """The deferred per-step stop check (in place of Lightning's blocking broadcast): rank 1's signal,
    recorded after step 2, stops both ranks at step 4 with exit code 143 (Lightning's own check: only
    rank 0's signal counts), and rank 0 does not wait for rank 1, which comes 50 ms after it to every step."""
    from tests._harness import check

    for result in run_ranks("tests/workers/sigterm_check.py", 2, str(tmp_path), timeout=100):
        check(result)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["raised"], r["code"], r["stopped_by"]) for r in ranks] == [(4, 143, 15)] * 2
    # the barrier before the raise waits 50 ms for rank 1; Lightning's blocking broadcast adds 4 × 50 ms
    assert ranks[0]["rank0_waited_s"] < 0.15, ranks[0]
