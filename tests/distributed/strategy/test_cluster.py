"""The main job on a cluster: one output directory per job under torchrun (one node, two nodes on
localhost) and SLURM (emulated by its variables), a submitit sweep, an optuna sweep.

Every rank of a job must write into the directory rank 0 resolved: ``.hydra/`` and ``train.log``
from rank 0, ``train_rank<r>.log`` (rank-tagged lines) from the others, and nothing elsewhere.
"""

from __future__ import annotations

import csv
import math
import re
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from lightning_fabric.plugins.environments.lightning import find_free_network_port

from tests._harness import ROOT, _env
from tests.launch import run_job, run_processes

TRAIN = str(ROOT / "recipes" / "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _small(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(2000)))
    return [
        f"data.path={corpus}",
        "model.num_layers=2",
        "model.d_model=32",
        "model.d_ff=64",
        "model.warmup_steps=2",
        "data.batch_size=16",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "throughput_window=2",
    ]


def _check(results: list[tuple[int, str]]) -> str:
    out = "\n".join(text for _, text in results)
    assert all(code == 0 for code, _ in results), out[-6000:]
    return out


def _only_job_dir(root: Path) -> Path:
    """The one directory a job made under ``root`` (``outputs/<task>``)."""
    dirs = [p for p in root.iterdir() if p.is_dir()]
    assert len(dirs) == 1, f"one directory per job expected, found {sorted(p.name for p in dirs)}"
    return dirs[0]


def _check_job_dir(job: Path, ranks: int, validated: bool = True, moved: bool = True) -> None:
    """Rank 0's files and every other rank's log in ``job``; with ``moved`` (the ranks composed the
    config themselves and started in a temporary directory of their own), that directory is gone."""
    assert (job / ".hydra" / "config.yaml").is_file()
    assert (job / "checkpoints" / "last.ckpt").is_file()
    rank0 = (job / "train.log").read_text()
    assert "[rank 0]" in rank0 and "[rank 1]" not in rank0, rank0[-2000:]
    assert "[train] outputs in" in rank0, rank0[-2000:]  # the summary goes to the log, not only to stdout
    for r in range(1, ranks):
        text = (job / f"train_rank{r}.log").read_text()
        assert f"[rank {r}]" in text and "[rank 0]" not in text, text
        found = re.search(rf"rank {r}: writing into rank 0's output directory (\S+) \(not (\S+)\)", text)
        if not moved:  # submitit shares the sweep's directory; Lightning's launcher passes the job's
            assert found is None, text
            continue
        assert found and Path(found.group(1)) == job.resolve(), text
        assert not Path(found.group(2)).exists()
    with (job / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    val = [float(row["val_loss"]) for row in rows if row.get("val_loss")]
    assert (len(val) > 0) == validated, rows


@pytest.mark.timeout(240)
def test_torchrun_one_node_writes_one_directory_and_says_when_no_validation_ran(tmp_path):
    """torchrun --nproc-per-node=2 with a run directory each rank resolves to its own (the time in
    microseconds): rank 1 removes its own once in rank 0's. trainer.max_steps below the validation
    interval: NaN, a warning naming trainer.val_check_interval, and a summary that lists only what
    exists."""
    task = f"tr_{uuid.uuid4().hex[:6]}"
    per_rank = f"hydra.run.dir=outputs/{task}/${{now:%H-%M-%S-%f}}"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node=2", TRAIN, *_small(tmp_path), per_rank]
    out = _check(run_job([*command, "trainer.val_check_interval=100"], cwd=tmp_path, env=_env(), timeout=220))
    job = _only_job_dir(tmp_path / "outputs" / task)
    _check_job_dir(job, ranks=2, validated=False)
    assert "val_loss is NaN: no validation ran" in out and "set trainer.val_check_interval" in out, out[
        -3000:
    ]
    listed = re.search(rf"\[train\] outputs in {re.escape(str(job))}: (.*)", out)
    assert listed, out[-3000:]
    assert (
        listed.group(1) == "checkpoints/ (last.ckpt), hparams.yaml, metrics.csv, train.log, train_rank1.log"
    )
    assert sorted(p.name for p in job.iterdir()) == [
        ".hydra",
        "checkpoints",
        "hparams.yaml",
        "metrics.csv",
        "train.log",
        "train_rank1.log",
    ]


# about 15 s; the one-node torchrun and Slurm tests cover the cluster path in the default suite
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_two_nodes_on_localhost_write_one_directory(tmp_path):
    """Two torchrun agents (--nnodes=2, c10d rendezvous), one rank each, trainer.num_nodes=2."""
    task = f"tr2_{uuid.uuid4().hex[:6]}"
    rendezvous = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{find_free_network_port()}",
        f"--rdzv-id={task}",
    ]
    args = [TRAIN, *_small(tmp_path), f"task_name={task}", "trainer.num_nodes=2"]
    nodes = [([*TORCHRUN, *rendezvous, f"--node-rank={n}", *args], _env()) for n in range(2)]
    _check(run_processes(nodes, cwd=tmp_path, timeout=220))
    _check_job_dir(_only_job_dir(tmp_path / "outputs" / task), ranks=2)


@pytest.mark.timeout(240)
def test_slurm_tasks_write_one_directory(tmp_path):
    """Two tasks of one SLURM job step, as srun starts them (its variables, emulated)."""
    task = f"slurm_{uuid.uuid4().hex[:6]}"
    env = _env()
    slurm = dict(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME=task,
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
    )
    tasks = [
        (
            [sys.executable, TRAIN, *_small(tmp_path), f"task_name={task}"],
            dict(env, **slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
        )
        for r in range(2)
    ]
    _check(run_processes(tasks, cwd=tmp_path, timeout=220))
    _check_job_dir(_only_job_dir(tmp_path / "outputs" / task), ranks=2)


@pytest.mark.slow  # about 2 min on 2 busy cores: 4 processes, submitit's start-up and polling
@pytest.mark.timeout(400)
def test_submitit_local_sweep_runs_each_job_as_two_tasks(tmp_path):
    """hydra/launcher=gpipe_local: a 2-job sweep, each job 2 processes started by submitit's local
    executor (tasks_per_node = pipeline_parallel_size × replicas), each job in its own directory."""
    sweep = tmp_path / "sweep"
    command = [
        sys.executable,
        TRAIN,
        "-m",
        "hydra/launcher=gpipe_local",
        "pipeline.chunks=1,2",
        *_small(tmp_path),
        f"hydra.sweep.dir={sweep}",
    ]
    out = _check(run_job(command, cwd=tmp_path, env=_env(), timeout=380))
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith(".")) == [
        "0",
        "1",
        "multirun.yaml",
    ]
    for job, chunks in (("0", 1), ("1", 2)):
        _check_job_dir(sweep / job, ranks=2, moved=False)
        assert yaml.safe_load((sweep / job / "hparams.yaml").read_text())["chunks"] == chunks
    # each job ran as 2 submitit tasks (one log each), not as one process that launched a child
    tasks = sorted(p.name for p in (sweep / ".submitit").rglob("*_log.out"))
    assert len(tasks) == 4 and {t.rsplit("_", 3)[-2] for t in tasks} == {"0", "1"}, (tasks, out[-3000:])


@pytest.mark.slow  # about 25 s; the multirun test in test_recipes covers Hydra sweeps in the default suite
@pytest.mark.timeout(240)
def test_optuna_sweep_runs_two_trials_on_throughput(tmp_path):
    """hparams_search=pipeline_optuna with 2 trials: each trial is a 2-process job returning samples/s."""
    sweep = tmp_path / "sweep"
    command = [
        sys.executable,
        TRAIN,
        "-m",
        "hparams_search=pipeline_optuna",
        "hydra.sweeper.n_trials=2",
        *_small(tmp_path),
        f"hydra.sweep.dir={sweep}",
    ]
    out = _check(run_job(command, cwd=tmp_path, env=_env(), timeout=220))
    assert out.count("[train] 2 stages,") == 2, out[-3000:]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"pipeline.chunks", "pipeline.balance"}
    assert math.isfinite(results["best_value"]) and results["best_value"] > 0
    for job in ("0", "1"):
        _check_job_dir(sweep / job, ranks=2, moved=False)
