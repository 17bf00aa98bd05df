"""The launcher: the Hydra child command of a job, and undoing a launch in the launching process."""

from __future__ import annotations

import os

import pytest
from hydra.core.hydra_config import HydraConfig

from lightning_gpipe.strategy.launcher import LAUNCH_ENV, GPipeLauncher, hydra_child_command
from tests.unit.recipes.test_recipes import _compose


def test_child_command_runs_this_job_only(tmp_path):
    cfg = _compose("pipeline.chunks=4", "data.path=corpus.txt", hydra=True)
    job_dir = tmp_path / "sweep dir" / "3"
    cfg.hydra.runtime.output_dir = str(job_dir)
    cfg.hydra.runtime.cwd = str(tmp_path)
    cfg.hydra.job.chdir = True
    cfg.hydra.overrides.hydra = ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}", "hydra.verbose=true"]
    HydraConfig.instance().set_config(cfg)
    try:
        command, cwd = hydra_child_command(local_rank=1)
    finally:
        HydraConfig.instance().cfg = None
    assert cwd == str(tmp_path)
    script, overrides = command[:-8], command[-8:]
    assert len(script) <= 3  # python script.py, or python -m module: nothing of the parent's sweep
    assert overrides == [
        "pipeline.chunks=4",
        "data.path=corpus.txt",
        "hydra.verbose=true",
        "hydra.mode=RUN",
        f"hydra.run.dir='{job_dir}'",
        "hydra.output_subdir=null",
        f"hydra.job.name={cfg.hydra.job.name}_rank1",
        "hydra.job.chdir=true",
    ]


@pytest.mark.parametrize("user_port", [None, "29123"])
def test_release_restores_the_environment_and_frees_the_port(user_port, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # set by the user: kept
    for key in ("MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if user_port:
        monkeypatch.setenv("MASTER_PORT", user_port)
    launcher = GPipeLauncher.__new__(GPipeLauncher)
    launcher.procs = []
    launcher._env_before = {key: os.environ.get(key) for key in LAUNCH_ENV}
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29123", NODE_RANK="0", LOCAL_RANK="0", WORLD_SIZE="2"
    )
    launcher.release()
    assert os.environ["MASTER_ADDR"] == "10.0.0.1"
    assert not {"NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(os.environ)
    if user_port:  # the next job must not meet the last job's store on the old port
        assert os.environ["MASTER_PORT"] != "29123"
    else:
        assert "MASTER_PORT" not in os.environ
    launcher.release()  # a second call (or one in a child rank) does nothing
