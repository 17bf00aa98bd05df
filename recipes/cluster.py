"""One output directory per job and rank-tagged logs, whatever starts the job's processes.

Lightning's own launcher starts ranks 1.. with the job's directory on their command line
(:func:`lightning_gpipe.strategy.launcher.hydra_child_command`); submitit's tasks share the directory of
their job in a Hydra sweep (the sweep's resolved values travel with the pickled job). An external
launcher of a plain run (``torchrun``, ``srun`` under SLURM) starts every rank itself, and each
process composes its config on its own: resolved there, ``${now:...}`` would give each rank its
own directory. So:

- the run directory is written ``${rank_zero_dir:<dir>}`` (``conf/train.yaml``): rank 0 keeps
  ``<dir>``; any other rank of an externally started job gets a temporary directory of its own
  for the moments before the job's processes connect;
- once they are connected, :class:`SharedOutputDir` (a callback) broadcasts rank 0's directory;
  every other rank moves its log file there (``<job name>_rank<r>.log``, with what it logged so
  far), changes into it when Hydra had changed into its own, and removes its temporary directory,
  or, when ``hydra.run.dir`` gave each rank a directory of its own (``${now:...}`` given on the
  command line), what it wrote there, and that directory once empty.
  Checkpoints follow by themselves (``ModelCheckpoint`` broadcasts its directory from rank 0); the
  loggers and the timeline write on rank 0 only.

The rank is read before any connection exists, from the variables the launchers set, through
Lightning's cluster environments (:func:`launch_rank`). Resolvers registered on import:
``${global_rank:}`` (the rank, for log lines), ``${rank_suffix:}`` (``""`` on rank 0, ``_rank<r>``
elsewhere), ``${rank_zero_dir:<dir>}``, and for ``conf/hydra/launcher/gpipe_*.yaml``
``${tasks_per_node:stages,replicas,nodes}`` and ``${gpus_per_node:accelerator,tasks}``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from omegaconf import OmegaConf
from pytorch_lightning.callbacks import Callback

__all__ = [
    "SharedOutputDir",
    "SubmititLocalEnvironment",
    "cluster_environment",
    "launch_rank",
    "register_resolvers",
]

log = logging.getLogger(__name__)

# Lightning's own order of detection (``_AcceleratorConnector``), the first that detects wins;
# Kubeflow is left out: Lightning cannot detect it from the environment either.
EXTERNAL_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    SLURMEnvironment,
    TorchElasticEnvironment,
    LSFEnvironment,
)

# Prefix of the directory a rank other than 0 uses until it knows rank 0's.
TEMP_PREFIX = "gpipe-rank-"
# What Hydra writes into a run directory's .hydra/.
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


class SubmititLocalEnvironment(ClusterEnvironment):
    """The tasks of a job of submitit's local executor (``hydra/launcher=gpipe_local``).

    The local executor starts ``tasks_per_node`` processes per job, as ``srun`` would, but sets
    ``SUBMITIT_LOCAL_*`` variables rather than SLURM's, which no Lightning environment reads.
    This one reads them: ranks from ``SUBMITIT_LOCAL_GLOBALID``/``LOCALID``, the world from
    ``SUBMITIT_LOCAL_NTASKS``, one node; the address is this machine and the port is derived
    from the job id (the executor's process id), the same in every task of the job, as
    Lightning's :class:`SLURMEnvironment` derives it from the SLURM job id.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 15000 + int(os.environ["SUBMITIT_LOCAL_JOB_ID"]) % 20000

    @staticmethod
    def detect() -> bool:
        return "SUBMITIT_LOCAL_JOB_ID" in os.environ and "SUBMITIT_LOCAL_GLOBALID" in os.environ

    def world_size(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_NTASKS"])

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the executor

    def global_rank(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_GLOBALID"])

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the executor

    def local_rank(self) -> int:
        return int(os.environ["SUBMITIT_LOCAL_LOCALID"])

    def node_rank(self) -> int:
        return 0


def launch_rank() -> tuple[int, bool]:
    """This process's global rank as its launcher set it, before any connection.

    Returns:
        tuple[int, bool]: the rank, and whether the processes were started by an external
        launcher (Lightning's cluster environments: SLURM, torchelastic/``torchrun``, LSF; or
        :class:`SubmititLocalEnvironment`). Otherwise the rank comes from ``RANK``, then
        ``LOCAL_RANK`` (a rank Lightning's launcher started), else 0; ``NODE_RANK`` > 0 makes a
        process of a hand-started multi-node job count as not rank 0.
    """
    for environment in (*EXTERNAL_ENVIRONMENTS, SubmititLocalEnvironment):
        if environment.detect():
            return environment().global_rank(), True
    for key in ("RANK", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key]), key == "RANK"
    return (1 if int(os.environ.get("NODE_RANK", "0")) > 0 else 0), False


@functools.cache  # one temporary directory per process, however often Hydra resolves the config
def _rank_zero_dir(directory: str) -> str:
    rank, external = launch_rank()
    if external and rank != 0:
        return tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{rank}-")
    return directory


def register_resolvers() -> None:
    """Register ``global_rank``, ``rank_suffix``, ``rank_zero_dir``, ``tasks_per_node`` and
    ``gpus_per_node`` with OmegaConf (idempotent)."""
    OmegaConf.register_new_resolver("global_rank", lambda: launch_rank()[0], replace=True)
    OmegaConf.register_new_resolver(
        "rank_suffix", lambda: f"_rank{launch_rank()[0]}" if launch_rank()[0] else "", replace=True
    )
    OmegaConf.register_new_resolver("rank_zero_dir", _rank_zero_dir, replace=True, use_cache=True)
    # conf/hydra/launcher/gpipe_*.yaml: tasks per node and GPUs per node of a job
    OmegaConf.register_new_resolver(
        "tasks_per_node",
        lambda stages, replicas, nodes: int(stages) * int(replicas) // int(nodes),
        replace=True,
    )
    OmegaConf.register_new_resolver(
        "gpus_per_node",
        lambda accelerator, tasks: tasks if accelerator in ("gpu", "cuda") else None,
        replace=True,
    )


register_resolvers()  # on import: a submitit task unpickles the job function and imports this module


class SharedOutputDir(Callback):
    """Every rank of the job adopts rank 0's output directory once the processes are connected.

    Args:
        output_dir (str | Path): this rank's directory as Hydra made it.
        chdir (bool): whether Hydra changed into it (``hydra.job.chdir``); then the rank changes
            into rank 0's.

    Attributes:
        output_dir (Path): rank 0's directory after ``setup`` (this rank's before).
    """

    def __init__(self, output_dir: str | Path, chdir: bool = False) -> None:
        self.output_dir = Path(output_dir).resolve()
        self.chdir = chdir

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        shared = Path(trainer.strategy.broadcast(str(self.output_dir)))
        if shared == self.output_dir:
            return
        own, self.output_dir = self.output_dir, shared
        moved = _move_file_logs(own, shared)
        if self.chdir:
            os.chdir(shared)
        if own.name.startswith(TEMP_PREFIX) and Path(tempfile.gettempdir()) in own.parents:
            shutil.rmtree(own, ignore_errors=True)
        else:  # a run directory of its own (hydra.run.dir resolved per rank, e.g. by ${now:...})
            _remove_run_files(own, moved, shared)
        log.info(f"rank {trainer.global_rank}: writing into rank 0's output directory {shared} (not {own})")


def _move_file_logs(old: Path, new: Path) -> list[Path]:
    """Re-point every logging file handler writing under ``old`` to the same name under ``new``,
    keeping the lines already written; returns the files left under ``old``."""
    moved: list[Path] = []
    for handler in list(logging.getLogger().handlers):
        if not isinstance(handler, logging.FileHandler):
            continue
        path = Path(handler.baseFilename)
        if old not in path.parents:
            continue
        target = new / path.relative_to(old)
        handler.acquire()
        try:
            handler.flush()
            handler.close()
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a") as out, path.open() as written:
                out.write(written.read())
            handler.baseFilename = str(target)
            handler.mode = "a"
            moved.append(path)
        finally:
            handler.release()
    return moved


def _remove_run_files(own: Path, moved: list[Path], shared: Path) -> None:
    """Remove what this rank wrote into a run directory of its own before it knew rank 0's
    (``shared``): the log files it moved, Hydra's ``.hydra/`` (rank 0 wrote the job's), and the
    directory and its parents below the one it shares with ``shared`` when that leaves them empty.
    Anything else is left as it is."""
    for path in moved:
        path.unlink(missing_ok=True)
    hydra = own / ".hydra"
    if hydra.is_dir() and {p.name for p in hydra.iterdir()} <= set(HYDRA_FILES):
        shutil.rmtree(hydra, ignore_errors=True)
    try:
        own.rmdir()
    except OSError:  # not empty: not only this rank's
        log.warning(f"left {own}: it holds files this rank did not write (the job's directory is rank 0's)")
        return
    common = Path(os.path.commonpath([own, shared]))
    parent = own.parent
    while common in parent.parents:  # e.g. outputs/<date>/ of a date rank 0 did not resolve
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def cluster_environment() -> Any:
    """The cluster environment to hand the strategy: :class:`SubmititLocalEnvironment` inside a
    task of submitit's local executor, else ``None`` (Lightning detects the others itself)."""
    return SubmititLocalEnvironment() if SubmititLocalEnvironment.detect() else None
