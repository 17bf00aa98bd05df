"""Signals end in a checkpoint, dead ranks are named (issue 41, items 4 and 5).

SIGTERM to the launching rank, to one rank or to the whole job, and a first SIGINT, stop every rank
at the same step boundary, where Lightning's on_exception callbacks run: OnExceptionCheckpoint
writes a checkpoint from which a plain one-device run resumes to the weights of an uninterrupted
run. A rank killed with SIGKILL, during the forward or while the others wait for it in a checkpoint
gather, is named by every survivor within seconds, whoever launched the job.

The jobs (tests/workers/faults.py) train on one batch per epoch, so that every step boundary is an
epoch's start, where Lightning resumes a plain DataLoader exactly. Each runs under one of three
launches: ``lightning`` (one process; Lightning's launcher starts the others), ``torchrun`` (every
rank started torchrun-style, with RANK and WORLD_SIZE set and no agent, as ``srun`` starts tasks) and
``torchrun-agent`` (``python -m torch.distributed.run``: its agent starts the ranks, each in a session
of its own, and passes a SIGTERM it gets on to them).
"""

import json
import os
import signal as signals
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.run

from tests._harness import ROOT, _env, run_ranks, run_script
from tests.conftest import max_diff
from tests.launch import run_job
from tests.models import train_single_device

STEPS = 5
AT = 2  # the signal comes once global_step == AT; every rank stops with AT + 1 steps done
NAMED_WITHIN_S = 10.0


def _run(tmp_path, launch: str, devices: int, **spec) -> tuple[list[tuple[int, str]], float]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"out": str(tmp_path), "devices": devices, "steps": STEPS, **spec}))
    start = time.monotonic()
    if launch == "lightning":
        results = [run_script("tests/workers/faults.py", str(path), timeout=120)]
    elif launch == "torchrun-agent":  # `torchrun`, its agent forked from the tests' fork server when usable
        run = torch.distributed.run.__file__
        agent = [sys.executable, run, "--standalone", f"--nproc-per-node={devices}"]
        command = [*agent, str(ROOT / "tests" / "workers" / "faults.py"), str(path)]
        results = run_job(command, cwd=ROOT, env=_env(), timeout=120)
        _check_no_rank_left(tmp_path, devices)  # the agent's workers are not in its process group
    else:
        results = run_ranks("tests/workers/faults.py", devices, str(path), timeout=120)
    return results, time.monotonic() - start  # run_job returns once every process of the job has ended


def _check_no_rank_left(tmp_path, devices: int) -> None:
    """Every rank whose pid the job wrote has ended; one still running is killed and fails the test."""
    left = []
    for rank in range(devices):
        pid = int((tmp_path / f"pid{rank}").read_text())
        try:  # the pid is still this job's rank (not reused) while its command line names the job's spec
            running = str(tmp_path / "spec.json") in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        except OSError:
            running = False
        if running:
            os.kill(pid, signals.SIGKILL)
            left.append(rank)
    assert not left, f"ranks {left} were still running after the job's launcher ended"


def _one_device(steps: int, val: bool = False, ckpt_path: str | None = None):
    """The same module and data under a plain one-device Trainer."""
    extra = {"max_epochs": -1}
    data = {"samples": 10}
    return train_single_device(
        "mlp", 0, steps=steps, trainer_extra=extra, data=data, val=val, ckpt_path=ckpt_path
    )


_SLOW = pytest.mark.slow
# (launch, the signal's spec); the Lightning and torchrun-agent launches cost some 10 to 15 s each on 2 cores
_SIGNALS = [
    pytest.param(
        "lightning", {"rank": 0, "name": "SIGTERM", "to": "self", "during": "step"}, id="sigterm-to-launcher"
    ),
    pytest.param(  # a rank Lightning's launcher started: the launching rank, never signalled, stops too
        "lightning",
        {"rank": 1, "name": "SIGTERM", "to": "self", "during": "step"},
        id="sigterm-to-one-launched-rank",
    ),
    pytest.param(  # the launcher passes it on too: the launched rank gets it twice
        "lightning",
        {"rank": 1, "name": "SIGTERM", "to": "group", "during": "save"},
        id="sigterm-to-process-group-in-checkpoint-save",
    ),
    pytest.param(  # torchrun's agent: its process group (as SLURM signals a task, Kubernetes a container's
        "torchrun-agent",  # main process) holds the agent alone, which passes the signal on to every rank
        {"rank": 1, "name": "SIGTERM", "to": "launcher-group", "during": "step"},
        id="sigterm-to-torchrun-agent-and-its-process-group",
    ),
    pytest.param(  # one rank under torchrun's agent: the agent sees it end and signals the others again
        "torchrun-agent",
        {"rank": 1, "name": "SIGTERM", "to": "self", "during": "step"},
        id="sigterm-to-one-rank-under-torchrun-agent",
        marks=_SLOW,  # a signal to one rank is in the default suite above, started torchrun-style
    ),
    pytest.param(
        "torchrun",
        {"rank": 1, "name": "SIGTERM", "to": "self", "during": "validation"},
        id="sigterm-to-one-rank-in-validation",
    ),
    pytest.param(  # as SLURM or Kubernetes signal every task of a job
        "torchrun",
        {"rank": "all", "name": "SIGTERM", "to": "self", "during": "save"},
        id="sigterm-to-every-rank-in-checkpoint-save",
    ),
    pytest.param(
        "torchrun",
        {"rank": 1, "name": "SIGINT", "to": "self", "during": "step"},
        id="sigint-to-one-rank",
    ),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("launch", "what"), _SIGNALS)
def test_signal_stops_every_rank_at_one_step_and_the_checkpoint_resumes_exactly(tmp_path, launch, what):
    """Every rank exits with 128 + the signal, all at global step AT + 1; the job ends within a minute;
    OnExceptionCheckpoint's file holds one device's weights after AT + 1 steps, and resuming from it
    on one device ends where an uninterrupted run does."""
    during = what["during"]
    results, seconds = _run(
        tmp_path,
        launch,
        2,
        strategy={"chunks": 2, "signal_grace": 30},
        signal={**what, "at": AT},
        val=during == "validation",
        every_step_checkpoint=during == "save",
    )
    code = 128 + getattr(signals, what["name"])
    output = "\n".join(out for _, out in results)
    if launch == "torchrun-agent":  # torch's agent ends with 1 (its SignalException, or a rank's failure)
        assert [rc for rc, _ in results] == [1], output[-4000:]
    else:
        assert [rc for rc, _ in results] == [code] * len(results), output[-4000:]
    assert seconds < 60, f"the job took {seconds:.0f} s"
    for rank in range(2):
        ended = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (ended["type"], ended["code"], ended["global_step"]) == ("SIGTERMException", code, AT + 1), (
            rank,
            ended,
            output[-4000:],
        )
        assert f"stage {1 - rank} (rank {rank}) stopped on {what['name']} with every rank" in output
    assert "worker rank" not in output and ") failed: " not in output, output[-4000:]

    ckpt = tmp_path / "on_exception.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == AT + 1
    at_stop = _one_device(AT + 1, val=during == "validation")
    assert max_diff(saved["state_dict"], at_stop.state_dict()) <= 1e-5
    resumed = _one_device(STEPS, val=during == "validation", ckpt_path=str(ckpt))
    straight = _one_device(STEPS, val=during == "validation")
    assert max_diff(resumed.state_dict(), straight.state_dict()) <= 1e-5


_KILLS = [  # (launch, devices, the kill's spec, the dead rank as named, the survivors)
    pytest.param(  # stage 0 of three dies in its forward: stage 1 waits on it, stage 2 on stage 1
        "torchrun", 3, {"layer": 0, "call": 5}, "rank 2 (stage 0)", [0, 1], id="in-forward-of-3-stages"
    ),
    pytest.param(  # rank 0 dies in its forward, and with it the job's store
        "torchrun", 2, {"layer": 4, "call": 5}, "rank 0 (stage 1)", [1], id="store-holder-in-forward"
    ),
    pytest.param(  # rank 1 dies while rank 0 waits for it in a checkpoint's gather (collective_timeout 120 s)
        "torchrun",
        2,
        {"rank": 1, "at": 2, "during": "save"},
        "rank 1 (stage 0)",
        [0],
        id="in-checkpoint-gather",
    ),
    pytest.param(  # the same under Lightning's launcher: a launched rank of three dies, the launching
        "lightning",  # rank and the other launched one wait in the gather
        3,
        {"rank": 1, "at": 2, "during": "save"},
        "rank 1 (stage 1)",
        [0, 2],
        id="launched-rank-of-3-in-checkpoint-gather",
    ),
    pytest.param(  # under torchrun's agent, which signals the survivor (SIGTERM) once it sees the rank end
        "torchrun-agent",
        2,
        {"layer": 0, "call": 5},
        "rank 1 (stage 0)",
        [0],
        id="under-torchrun-agent-in-forward",
        marks=_SLOW,  # the default suite kills ranks started torchrun-style above
    ),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("launch", "devices", "kill", "dead", "survivors"), _KILLS)
def test_a_rank_killed_with_sigkill_is_named_by_every_survivor_within_seconds(
    tmp_path, launch, devices, kill, dead, survivors
):
    strategy = {"chunks": 2, "collective_timeout": 120}
    results, seconds = _run(tmp_path, launch, devices, strategy=strategy, kill=kill)
    output = "\n".join(out for _, out in results)
    died = json.loads((tmp_path / "died").read_text())
    assert f"rank {died['rank']} " in dead + " "
    for rank in survivors:
        ended = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert f"{dead} died or lost its connection" in ended["message"], (rank, ended, output[-4000:])
        after = ended["time"] - died["time"]
        assert after < NAMED_WITHIN_S, f"rank {rank} named the dead rank {after:.1f} s after it died"
    assert all(rc != 0 for rc, _ in results)
    assert "is printed above" not in output and "call it on every rank" not in output
    assert seconds < 60, f"the job took {seconds:.0f} s"
