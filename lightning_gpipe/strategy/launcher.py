"""Process launcher: Lightning's subprocess launcher, validating before any child starts.

Under Hydra the child ranks run the *current job's* overrides in the *current job's* output
directory. Lightning's own Hydra command re-runs the whole command line, so in a multirun
(``-m pipeline.chunks=1,4,8``) every child would start a sweep of its own and write its own
timestamped directories.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch.distributed as dist
from lightning_fabric.plugins import ClusterEnvironment
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_gpipe import _lightning
from lightning_gpipe._lightning import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_gpipe.partition import compiling
from lightning_gpipe.strategy import process_group
from lightning_gpipe.strategy._namespace import PYTORCH_LIGHTNING, lightning_class, specialize
from lightning_gpipe.strategy.observer import ChildObserver
from lightning_gpipe.transport import rendezvous

if TYPE_CHECKING:  # the logic is typed as the pytorch_lightning launcher it becomes
    _Base = SubprocessScriptLauncher
    _ForkBase = MultiProcessingLauncher
else:
    _Base = _ForkBase = object

log = logging.getLogger(__name__)

# What Lightning's launcher writes into the launching process' environment for its children.
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")

# Hydra settings a child must not inherit from the parent's command line: the child is one plain
# run of one job (no sweep), in the job's directory, without a second ``.hydra/``.
_HYDRA_KEYS_SET_FOR_CHILDREN = (
    "hydra.mode",
    "hydra.run.",
    "hydra.sweep.",
    "hydra.sweeper.",
    "hydra.launcher.",
    "hydra/sweeper",
    "hydra/launcher",
    "hydra.output_subdir",
    "hydra.job.chdir",
    "hydra.job.name",
)


class _GPipeLauncherLogic(_Base):
    """Starts one process per stage by re-running the script (Lightning's "popen" launcher).

    Before the children start, ``check(model)`` validates the model against the strategy's
    configuration (the pipelined Sequential exists, the balance fits it), so a bad configuration
    fails in one process, fast. A module that overrides ``configure_model`` may build its
    Sequential only there, once the processes run: every rank checks it at setup instead.

    Under Hydra (``@hydra.main``), child rank ``r`` runs :func:`hydra_child_command`: the script
    with this job's overrides only, ``hydra.run.dir`` set to this job's output directory and no
    ``.hydra/`` of its own, from the original working directory. Without Hydra it re-runs
    ``sys.argv`` as Lightning does.

    After a job, :meth:`release` undoes the launch in the launching process (the next job of a
    Hydra multirun runs in the same process and must launch afresh).

    Args:
        cluster_environment, num_processes, num_nodes: as for Lightning's subprocess launcher.
        check: called with the LightningModule before any child starts; raises on a bad model.
        share: ``share(results, trainer)``, called on every rank with what the Trainer's entry point
            returned; its return value is returned instead (the last stage's results everywhere).
        grace: seconds the ranks it started get to end by themselves after a stop (a signal, Ctrl-C)
            before they are killed (``GPipeStrategy(signal_grace=...)``).
    """

    namespace: str  # "pytorch_lightning" or "lightning" (lightning_gpipe.strategy._namespace)

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        check: Callable[[pl.LightningModule], Any] | None = None,
        share: Callable[[Any, Any], Any] | None = None,
        grace: float = 30.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.check = check
        self.share = share
        self.grace = grace
        self._env_before: dict[str, str | None] | None = None
        self.in_launch = False  # inside launch(): the child observer may end a job that hangs

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = args[0] if args else None
        module_class = lightning_class(pl.LightningModule, self.namespace)
        if (
            isinstance(model, module_class)
            and self.check is not None
            # with configure_model the Sequential may not exist yet: setup checks it
            and not is_overridden("configure_model", model, parent=module_class)
        ):
            self.check(model)  # type: ignore[arg-type]
        self.in_launch = True
        try:
            results = self._start_and_run(function, *args, **kwargs)
        except BaseException:
            # This process failed. Before the rendezvous the ranks it started wait for it with no
            # connection to break: they end now, not at the timeout. After it, they end through the
            # failure protocol, saying why (which runs after this, in Lightning's on_exception), or by
            # themselves after a signal, once their on_exception callbacks (a checkpoint's gather needs
            # every rank) have run; an exit hook gives those left the grace, then kills them.
            if not dist.is_initialized():
                self._end_children(0.0)
            raise
        finally:
            self.in_launch = False
        return self.share(results, trainer) if self.share is not None else results

    def _start_and_run(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """Lightning's launch: start the other ranks, then run ``function`` here; the ranks started are
        watched by a :class:`~lightning_gpipe.strategy.observer.ChildObserver` (the job's grace) in place of
        Lightning's observer, which kills the whole job 5 s after a rank's failure."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            ChildObserver(self.procs, self.grace, lambda: self.in_launch).start()
            atexit.register(self._end_children, self.grace)
        _lightning.set_num_threads_if_needed(self.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Pass ``signum`` on to the ranks this one started; a ``SIGKILL`` (Lightning's, after Ctrl-C)
        first gives them ``grace`` seconds to end by themselves."""
        if signum == signal.SIGKILL:
            self._end_children(self.grace)
        else:
            super().kill(signum)

    def _end_children(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for the ranks this one started to exit, then kill those left and
        wait until they are gone (a later call of the job then knows they will not come)."""
        deadline = time.monotonic() + wait
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        check_rerunnable_command()
        self.procs = []
        self._env_before = {key: os.environ.get(key) for key in LAUNCH_ENV}
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            env = dict(os.environ, LOCAL_RANK=str(local_rank))
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env.pop("PL_GLOBAL_SEED", None)
            if _hydra_initialized():
                command, cwd = hydra_child_command(local_rank)
            else:
                command, cwd = _plain_child_command(), None
            log.debug(f"gpipe: starting local rank {local_rank}: {command} in {cwd or os.getcwd()}")
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))
        rendezvous.watch(functools.partial(ended_ranks, self.procs))  # a later fit of the job names them

    def release(self, timeout: float = 60.0) -> None:
        """End this launch in the process that launched: the next ``fit`` may launch again.

        Waits up to ``timeout`` seconds for the child ranks to exit (then kills them), tears this
        rank's connection down (:func:`~lightning_gpipe.strategy.process_group.disconnect`), forgets
        the job's store (:mod:`lightning_gpipe.transport.rendezvous`: the next ``fit`` connects
        through the environment, with the new ranks) and restores ``MASTER_ADDR``, ``NODE_RANK``,
        ``LOCAL_RANK`` and ``WORLD_SIZE`` to their values before the launch (removed if they were
        not set). Left
        set, a stale ``LOCAL_RANK`` makes Lightning believe the next job's processes are created
        externally. ``MASTER_PORT`` is removed too, so that the next Trainer's environment picks
        a free port; if it was set before the launch, it is set to a fresh free port instead:
        the last job's store keeps listening on the old port until its process groups are
        garbage-collected, and a second store on that port can leave the next job's ranks
        waiting for each other. Call it once per job, after the last ``fit``/``validate``/
        ``test`` of the Trainer. Does nothing in a child rank.

        Args:
            timeout (float): seconds to wait for the children, all together (default: 60).

        Raises:
            RuntimeError: if a child rank exited with a non-zero code, naming its local rank.
        """
        if self._env_before is None:
            return
        deadline = time.monotonic() + timeout
        failed = []
        for local_rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning(
                    f"gpipe: local rank {local_rank} (pid {proc.pid}) still runs after {timeout} s; "
                    "killing it"
                )
                proc.kill()
                code = proc.wait()
            if code != 0:
                failed.append(f"local rank {local_rank} (pid {proc.pid}): exit code {code}")
        process_group.disconnect()
        rendezvous.leave()
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            elif key == "MASTER_PORT":  # the last job's store may listen there until its groups are collected
                os.environ[key] = str(find_free_network_port())
            else:
                os.environ[key] = value
        self._env_before, self.procs = None, []
        if failed:
            raise RuntimeError("gpipe: child ranks failed: " + "; ".join(failed))


def ended_ranks(procs: Sequence[subprocess.Popen]) -> str | None:
    """Which of the ranks ``procs`` (local ranks 1, 2, ...) have exited, for a message (``None``: none)."""
    ended = [
        f"local rank {r} (pid {p.pid}, exit code {p.returncode})"
        for r, p in enumerate(procs, start=1)
        if p.poll() is not None
    ]
    return f"the ranks this process started have exited: {', '.join(ended)}" if ended else None


class GPipeLauncher(_GPipeLauncherLogic, SubprocessScriptLauncher):
    __doc__ = _GPipeLauncherLogic.__doc__
    namespace = PYTORCH_LIGHTNING


class _GPipeForkLauncherLogic(_ForkBase):
    """Starts one process per stage by forking this one (``strategy="gpipe_notebook"``).

    Lightning's ``ddp_notebook`` path (its multiprocessing launcher with ``start_method="fork"``):
    works in Jupyter and ``python -i``, where there is no script to re-run. Every rank, rank 0
    included, is a forked child; this process waits, then takes rank 0's results: the trained
    weights (the whole model: after ``fit`` every rank holds every stage's weights),
    ``trainer.state`` and ``callback_metrics``. As for ``ddp_notebook``, CUDA must not be
    initialized before the fork.

    Args:
        strategy: the strategy (Lightning's launcher reads its processes and cluster environment).
        check: called with the LightningModule before any process starts; raises on a bad model.
    """

    namespace: str

    def __init__(self, strategy: Any, check: Callable[[pl.LightningModule], Any] | None = None) -> None:
        super().__init__(strategy, start_method="fork")
        self.check = check

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = args[0] if args else None
        wrappers = []  # the user's torch.compile wrappers: put back here (the forked ranks put back theirs)
        if isinstance(model, lightning_class(pl.LightningModule, self.namespace)) and self.check is not None:
            wrappers = compiling.compiled_sequentials(model)  # type: ignore[arg-type]
            self.check(model)  # type: ignore[arg-type]
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            compiling.recompile(wrappers)


class GPipeForkLauncher(_GPipeForkLauncherLogic, MultiProcessingLauncher):
    __doc__ = _GPipeForkLauncherLogic.__doc__
    namespace = PYTORCH_LIGHTNING


def check_start_method(start_method: str) -> str:
    """``start_method`` as given.

    Raises:
        ValueError: it is not ``"popen"`` or ``"fork"``.
    """
    if start_method not in ("popen", "fork"):
        raise ValueError(
            f"start_method must be 'popen' or 'fork' (start_method: {start_method!r}); "
            "'fork' is for notebooks"
        )
    return start_method


def new_launcher(strategy: Any) -> GPipeLauncher | GPipeForkLauncher:
    """The launcher of a ``GPipeStrategy`` (its ``start_method``), in the strategy's Lightning namespace.

    Raises:
        ValueError: ``Trainer(sync_batchnorm=True)``.
        RuntimeError: ``start_method="popen"`` with several processes in an interactive session.
    """
    if _lightning.layer_sync(strategy) is not None:
        raise ValueError(
            "Trainer(sync_batchnorm=True) is not supported by the gpipe strategy (each stage holds different "
            "layers); use GPipeStrategy(deferred_batch_norm=True) for full-batch running statistics"
        )
    if strategy.start_method == "fork":
        return specialize(GPipeForkLauncher, strategy.namespace)(strategy, check=strategy.check_model)
    if _lightning.IS_INTERACTIVE and strategy.num_processes * strategy.num_nodes > 1:
        raise RuntimeError(
            "Trainer(strategy='gpipe') starts the other ranks by re-running the script, which an interactive "
            "session (Jupyter, python -i) does not have; "
            "use Trainer(strategy='gpipe_notebook') (forked ranks), "
            "or run the code as a script"
        )
    assert strategy.cluster_environment is not None
    return specialize(GPipeLauncher, strategy.namespace)(
        strategy.cluster_environment,
        strategy.num_processes,
        strategy.num_nodes,
        check=strategy.check_model,
        share=strategy.share_evaluation_results,
        grace=strategy.signal_grace,
    )


def set_world_ranks(
    env: ClusterEnvironment | None, node_rank: int, local_rank: int, processes: int, nodes: int
) -> None:
    """Give the cluster environment this process' global rank and the world size (``processes`` per node),
    and ``rank_zero_only`` the global rank."""
    if env is not None:
        env.set_global_rank(node_rank * processes + local_rank)
        env.set_world_size(nodes * processes)
    rank = env.global_rank() if env is not None else 0
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def check_rerunnable_command() -> None:
    """Raise unless the other ranks can be started by re-running this process' command line.

    Raises:
        RuntimeError: the program came from ``python -c`` (``sys.argv[0] == "-c"``) or standard
            input (``python - < script.py``, ``sys.argv[0]`` ``"-"`` or ``""``): there is no file
            to re-run.
    """
    if sys.argv[0] in ("-c", "-", ""):
        source = "python -c" if sys.argv[0] == "-c" else "standard input"
        raise RuntimeError(
            f"the gpipe strategy starts the other ranks by re-running this program, which came from {source} "
            f"(sys.argv[0]: {sys.argv[0]!r}) and cannot be re-run; "
            "save it to a file and run `python file.py`, "
            'or, in an interactive session or notebook, use Trainer(strategy="gpipe_notebook") (forked ranks)'
        )


def _hydra_initialized() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def _script_command(argv0: str) -> list[str]:
    import __main__  # local import: see Lightning issue 15218

    if __main__.__spec__ is None:
        return [sys.executable, os.path.abspath(argv0)]
    return [sys.executable, "-m", __main__.__spec__.name]


def _plain_child_command() -> list[str]:
    return _script_command(sys.argv[0]) + sys.argv[1:]


def _quote(value: str) -> str:
    """A string as a quoted Hydra override value (paths may hold ``,``, ``=`` or spaces)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_child_command(local_rank: int) -> tuple[Sequence[str], str]:
    """The command and working directory of child rank ``local_rank`` of the current Hydra job.

    The command is the script with the job's own overrides (``hydra.overrides.task``: in a
    multirun, this job's values, not the sweep), the parent's Hydra overrides that are not about
    sweeping or directories, and::

        hydra.mode=RUN hydra.run.dir='<job output dir>' hydra.output_subdir=null
        hydra.job.chdir=<as the parent> hydra.job.name=<job name>_rank<local_rank>

    It runs from the original working directory, so relative paths on the command line mean
    the same on every rank (resolve them with ``hydra.utils.to_absolute_path``) and the child
    creates no directory besides the job's. Its log file is ``<job name>_rank<r>.log`` in the
    job's directory.

    Args:
        local_rank (int): the child's local rank (≥ 1).

    Returns:
        tuple[Sequence[str], str]: ``argv`` for :class:`subprocess.Popen` and its ``cwd``.

    Raises:
        ValueError: if Hydra is not initialized in this process.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    if not HydraConfig.initialized():
        raise ValueError("hydra_child_command needs a running Hydra job (HydraConfig is not initialized)")
    hydra_cfg = HydraConfig.get()
    cwd = get_original_cwd()
    command = _script_command(os.path.join(cwd, sys.argv[0]))
    command += list(hydra_cfg.overrides.task)
    command += [
        override
        for override in hydra_cfg.overrides.hydra
        if not override.lstrip("+~").startswith(_HYDRA_KEYS_SET_FOR_CHILDREN)
    ]
    output_dir = os.path.abspath(hydra_cfg.runtime.output_dir)
    command += [
        "hydra.mode=RUN",
        f"hydra.run.dir={_quote(output_dir)}",
        "hydra.output_subdir=null",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
    ]
    if hydra_cfg.job.chdir is not None:
        command.append(f"hydra.job.chdir={str(bool(hydra_cfg.job.chdir)).lower()}")
    return command, cwd
