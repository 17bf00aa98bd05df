"""``GPipeStrategy``: the Lightning glue. Each hook delegates to the module named for its idea.

Hook order (Lightning's automatic optimization): ``training_step`` runs the user's step, whose
call of the pipelined Sequential is the forward fill (:mod:`lightning_gpipe.engine.stage`), then the
loss message; ``backward`` runs the user's loss backward on the last stage and then the backward
drain on every stage; ``optimizer_step`` steps each stage's own optimizer on its own parameters.
Where the rest lives: rank layout (:mod:`~lightning_gpipe.transport.layout`), process groups
(:mod:`~lightning_gpipe.transport.groups`, bounded by :mod:`~lightning_gpipe.transport.arrival`), the balance
(:mod:`~lightning_gpipe.strategy.balance_spec`), the stage's life in the module from setup to teardown
(:mod:`~lightning_gpipe.strategy.pipelined`, cutting in :mod:`~lightning_gpipe.partition.cut`), its starting
weights (:mod:`~lightning_gpipe.state.start_state`, :mod:`~lightning_gpipe.state.materialize`), gradients
(:mod:`~lightning_gpipe.strategy.gradients`), the checkpoint hooks (:mod:`~lightning_gpipe.strategy.checkpoints`),
collectives (:mod:`~lightning_gpipe.strategy.collectives`),
metrics (:mod:`~lightning_gpipe.strategy.metrics`), the timeline (:mod:`~lightning_gpipe.tools.timeline`,
:mod:`~lightning_gpipe.tools.trace`), the launcher (:mod:`~lightning_gpipe.strategy.launcher`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only, rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe import _lightning, state
from lightning_gpipe.engine.recompute import check_mode
from lightning_gpipe.engine.rng import share_rng_state
from lightning_gpipe.errors import check_count
from lightning_gpipe.partition import cut as partition
from lightning_gpipe.partition.cut import PartitionError
from lightning_gpipe.schedule import check_schedule, check_virtual_stages
from lightning_gpipe.state import loading
from lightning_gpipe.state.loading import UnsafeCheckpointError
from lightning_gpipe.state.materialize import tensor_init_context
from lightning_gpipe.strategy import metrics, microstep, precision, process_group
from lightning_gpipe.strategy._namespace import PYTORCH_LIGHTNING, adopt, namespace_of
from lightning_gpipe.strategy.balance_spec import check_balance_spec
from lightning_gpipe.strategy.callbacks import adapt_callbacks, restore_callbacks
from lightning_gpipe.strategy.checkpoints import CheckpointHooks, SavedState
from lightning_gpipe.strategy.collectives import Collectives
from lightning_gpipe.strategy.gradients import clip_optimizer_gradients
from lightning_gpipe.strategy.launcher import check_start_method, new_launcher
from lightning_gpipe.strategy.pipelined import Pipelined, check_model, partition_model, unpartition_model
from lightning_gpipe.strategy.signals import SIGNAL_GRACE_S, SigtermCheck, watch_signals
from lightning_gpipe.strategy.steps import StepDriver
from lightning_gpipe.tools.timeline import Timeline
from lightning_gpipe.tools.trace import publish
from lightning_gpipe.transport import groups
from lightning_gpipe.transport.arrival import check_collective_timeout
from lightning_gpipe.transport.failure import report_and_abort
from lightning_gpipe.transport.layout import Layout, check_pipeline_parallel_size

if TYPE_CHECKING:  # the logic is typed as the pytorch_lightning strategy it becomes
    _Base = ParallelStrategy
else:
    _Base = object


class _GPipeStrategyLogic(CheckpointHooks, Collectives, _Base):
    """GPipe pipeline parallelism (Huang et al. 2019, arXiv 1811.06965) as a Lightning strategy.

    The LightningModule's ``nn.Sequential`` is cut into K consecutive stages, one per process;
    each mini-batch ``(N, *)`` is split into ``chunks × (≈N/chunks, *)`` micro-batches that
    stream through the stages (fill-drain); gradients accumulate over the micro-batches and one
    synchronous optimizer step follows. The result equals training the unpartitioned module on
    the whole mini-batch, up to float reassociation.

    One definition serves both Lightning namespaces (:mod:`lightning_gpipe.strategy._namespace`):
    ``GPipeStrategy`` is the ``pytorch_lightning`` class; ``L.Trainer`` (``import lightning as L``)
    accepts an instance too, which then takes the ``lightning.pytorch`` class.

    Args:
        chunks: number of micro-batches M per mini-batch (≥ 1; a batch of N < M samples gives N).
            ``None`` (the default): M = 4·K for K stages (GPipe's guidance M ≥ 4·K keeps the bubble
            (K-1)/(M+K-1) under 20 %), capped by each batch's size. ``chunks=1`` runs the whole
            mini-batch at once (no pipelining).
        balance: layers per stage, e.g. ``[3, 2]``; ``None`` splits as evenly as possible by layer
            count, earlier stages taking the extra layers; or a balancer: ``"uniform"``,
            ``"parameters"``, ``"time"`` or ``"memory"`` (:mod:`lightning_gpipe.strategy.balance_spec`).
            The chosen balance is logged (``gpipe_balance``) and stored in checkpoints (``"gpipe"``).
        checkpoint: re-materialization per micro-batch: ``"always"``, ``"except_last"`` (the
            last micro-batch's backward comes first, so it keeps its activations) or ``"never"``.
        schedule: ``"gpipe"`` (fill-drain, the default: ``training_step`` runs once on the whole
            batch) or ``"1f1b"`` (PipeDream-Flush: stage k holds at most K-k micro-batches'
            activations; ``training_step`` runs once per micro-batch, :mod:`lightning_gpipe.strategy.microstep`);
            the names of :data:`lightning_gpipe.schedule.SCHEDULES`; ``"interleaved_1f1b"``
            (Megatron-LM's interleaved 1F1B, with ``virtual_stages``); or ``"zb_h1"`` (Zero
            Bubble's ZB-H1: 1F1B with each backward split into the input gradient, sent at once,
            and the weight gradients, run later where the stage would idle; only micro-batches
            that are not recomputed split, so it wants ``checkpoint="never"``, and warns otherwise).
        virtual_stages: virtual stages per stage v (default ``None``: 2 under
            ``"interleaved_1f1b"``, else 1). With v > 1 (``schedule=
            "interleaved_1f1b"``, K ≥ 2) the Sequential is cut into K·v parts and stage j holds parts
            j, j+K, …, dividing the bubble by about v (:func:`lightning_gpipe.schedule.interleaved_1f1b`);
            ``balance`` then gives (or balances) K·v parts in model order. Skip connections across
            parts are refused.
        module_name: attribute path of the ``nn.Sequential`` to pipeline (e.g. ``"layers"``);
            ``None`` finds the only ``nn.Sequential`` holding every parameter.
        pipeline_parallel_size: stages per pipeline K; the world (``devices × num_nodes``) holds
            ``W / K`` data-parallel replicas. ``None``: K = W.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for any Lightning ``ParallelStrategy``; the Trainer fills them in.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks by device.
        timeout: ``torch.distributed`` timeout for collectives and point-to-point.
        timeline: record every stage's spans (:mod:`lightning_gpipe.tools.timeline`); at the end of ``fit``,
            log ``pipeline/bubble`` per step, write ``timeline.json`` and ``timeline.png``.
        timeline_dir: where those files go (default: the trainer's ``log_dir``).
        gradient_clip_norm_type: the norm that ``Trainer(gradient_clip_val=...,
            gradient_clip_algorithm="norm")`` clips by (2.0, or ``float("inf")``), computed over
            the gradients of all stages together, as on one device.
        deferred_batch_norm: BatchNorm running statistics updated once per mini-batch, equal to
            those of the unpartitioned model (:mod:`lightning_gpipe.engine.batchnorm`; GPipe section 2.2).
        optimizer_state_factor: optimizer state per parameter, in parameters (2.0: Adam's two
            moments), for ``balance="memory"``.
        checkpoint_format: ``"full"``: one Lightning checkpoint file, as the plain module's;
            ``"sharded"``: a directory, one shard per stage; both atomic (:mod:`lightning_gpipe.state`).
        collective_timeout: seconds every rank waits for the others at an operation that needs them
            all (barriers, broadcasts, ``reduce_boolean_decision``, gathering state for a checkpoint,
            sharing epoch metrics) before it fails with :class:`lightning_gpipe.transport.arrival.CollectiveTimeout`
            naming the operation and the ranks that did not arrive (:mod:`lightning_gpipe.transport.arrival`).
        compile: compile every stage's layers with ``torch.compile``: ``True`` (defaults) or a dict
            of its arguments (``{"backend": ..., "mode": ..., "dynamic": ...}``), applied after the
            cut, as Lightning's FSDP/ModelParallel strategies compile after wrapping. A Sequential
            the user compiled (``model.net = torch.compile(model.net, ...)``) is found too: it is cut
            uncompiled and each stage compiled with the user's own settings; the user's wrapper is
            back after ``fit``. A step that returns a loss without calling the pipelined Sequential
            raises ``PipelineUsageError`` ("the pipelined module was not called").
        start_method: ``"popen"``: the other ranks re-run the script (Lightning's default launcher);
            ``"fork"``: every rank is forked from this process, for Jupyter and ``python -i``
            (``strategy="gpipe_notebook"``, as ``ddp_notebook`` for DDP).
        weights_only: how checkpoint files are unpickled when ``fit``/``validate``/``test``/
            ``predict`` get ``ckpt_path=``: ``None`` or ``True``, torch's safe unpickler
            (tensors, containers, primitive types; anything else is refused with
            :class:`~lightning_gpipe.state.loading.UnsafeCheckpointError`, naming the file); ``False``,
            full pickle, which runs whatever the file names (only for files you trust).
            Lightning does not hand ``trainer.fit(weights_only=...)`` to strategies that restore
            after setup, so the opt-in is given here.

    Raises:
        ValueError: at construction, for a bad ``chunks``, ``checkpoint``, ``balance``, ``schedule`` or
            ``pipeline_parallel_size``; at ``Trainer`` construction, when the world size is not a
            multiple of ``pipeline_parallel_size``.
        PartitionError: before processes start, when the module cannot be cut as asked.
    """

    strategy_name = "gpipe"
    namespace: str  # "pytorch_lightning" or "lightning" (lightning_gpipe.strategy._namespace)

    def __init__(
        self,
        chunks: int | None = None,
        balance: list[int] | str | None = None,
        checkpoint: str = "except_last",
        module_name: str | None = None,
        pipeline_parallel_size: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        timeline: bool = False,
        timeline_dir: str | None = None,
        gradient_clip_norm_type: float = 2.0,
        checkpoint_format: str = "full",
        optimizer_state_factor: float = 2.0,
        deferred_batch_norm: bool = False,
        collective_timeout: float = 30.0,
        compile: bool | dict[str, Any] = False,
        start_method: str = "popen",
        weights_only: bool | None = None,
        schedule: str = "gpipe",
        virtual_stages: int | None = None,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.chunks = check_count("chunks", chunks) if chunks is not None else None
        self.checkpoint = check_mode(checkpoint)
        self.schedule = check_schedule(schedule)
        self.virtual_stages = check_virtual_stages(self.schedule, virtual_stages)
        if self.schedule == "zb_h1" and self.checkpoint != "never":
            rank_zero_warn(
                f"schedule='zb_h1' splits only the backwards of micro-batches whose forward is not "
                f"recomputed; under checkpoint={self.checkpoint!r} the others run whole at their B, as "
                "under 1F1B. Use checkpoint='never' for the zero-bubble gain."
            )
        self.balance = check_balance_spec(balance, pipeline_parallel_size, self.virtual_stages)
        self.pipeline_parallel_size = check_pipeline_parallel_size(pipeline_parallel_size)
        self.checkpoint_format = state.check_format(checkpoint_format)
        self.module_name = module_name
        self.gradient_clip_norm_type = float(gradient_clip_norm_type)
        self.optimizer_state_factor = float(optimizer_state_factor)
        self.deferred_batch_norm = bool(deferred_batch_norm)
        self.collective_timeout = check_collective_timeout(collective_timeout)
        self.weights_only = loading.check_weights_only(weights_only)
        self.timeline, self.timeline_dir = timeline, timeline_dir
        self.timeline_records: list[dict[str, Any]] | None = None  # rank 0, after fit with timeline=True
        self.last_grad_norm: Tensor | None = None  # total gradient norm before the last clip (inspection)
        self.process_group_backend = process_group_backend  # chosen by device at set-up when None
        self._timeout = timeout
        self.num_nodes = 1  # set by the Trainer
        self._pipelined = Pipelined()  # this rank's stage in the module, from setup to teardown
        self._groups: groups.Groups | None = None
        self._metric_sharing: metrics.ShareLastStageMetrics | None = None
        self._timeline: Timeline | None = None
        self._sigterm: SigtermCheck | None = None  # Lightning's per-step SIGTERM broadcast, deferred
        self._failed = False
        self.compile = partition.check_compile(compile)
        self.start_method = check_start_method(start_method)
        self._saved = SavedState(self._pipelined)  # the checkpoint hooks' work, the file being restored
        micro_steps = microstep.MicroSteps() if schedule != "gpipe" else None
        self._steps = StepDriver(
            self._pipelined, micro_steps, self.deferred_batch_norm
        )  # the step hooks' work

    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        """Set by the Trainer's connector first: the strategy takes the class of the Trainer's namespace."""
        adopt(self, namespace_of(accelerator))
        self._accelerator = accelerator

    # -- topology ------------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layout(self) -> Layout:
        """The rank layout: K stages × D replicas, last stage on each pipeline's lowest rank."""
        world = max(self.num_nodes * self.num_processes, 1)
        return Layout(world, self.pipeline_parallel_size or world)

    @property
    def stage_index(self) -> int:
        return self.layout.stage_of(self.global_rank)

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.layout.stages - 1

    @property
    def chunks_used(self) -> int:
        """Micro-batches per mini-batch: ``chunks``, or 4·K (K stages) when ``chunks`` is ``None``."""
        return self.chunks if self.chunks is not None else 4 * self.layout.stages

    @property
    def is_distributed(self) -> bool:
        """Lightning shards data (and syncs logs) only over data-parallel replicas: with one, every
        stage sees the user's batches in the user's order (no ``DistributedSampler``)."""
        return self.layout.replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        layout = self.layout
        return {"num_replicas": layout.replicas, "rank": layout.replica_of(self.global_rank)}

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None
        return module

    @property
    def last_received_skips(self) -> list[tuple[str, int]] | None:
        """``(skip, source stage)`` pairs this stage received, kept at teardown (inspection)."""
        return self._pipelined.received_skips

    @override
    def _configure_launcher(self) -> None:
        self.layout  # noqa: B018 - validates world size against pipeline_parallel_size before any spawn
        self._launcher = new_launcher(self)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        env, backend, device = self.cluster_environment, self.process_group_backend, self.root_device
        self.process_group_backend = process_group.connect(env, backend, self._timeout, device)
        share_rng_state(self.global_rank)  # a shuffling DataLoader draws alike on every rank
        if self._groups is None:
            self._groups = groups.new_groups(self.layout, self.global_rank)
        groups.close_at_exit(self)
        watch_signals(SIGNAL_GRACE_S, on_signal=self._forward_signal)

    # -- the model -------------------------------------------------------------------------------

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``Trainer.init_module`` and ``configure_model`` create tensors: on the meta device with
        ``empty_init=True`` (and ``None`` inside ``configure_model``), only this rank's stage materialized
        at setup; otherwise on this rank's device (:func:`.materialize.tensor_init_context`)."""
        with tensor_init_context(super().tensor_init_context, self.precision_plugin, empty_init):
            yield

    def check_model(self, model: pl.LightningModule) -> tuple[str, nn.Sequential, list[int]]:
        """Raise before any process starts if the model cannot be cut or run (:func:`.pipelined.check_model`)."""
        return check_model(self, model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        partition_model(self)  # before the optimizers: they only ever see this stage's parameters
        assert self.model is not None and self._groups is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        state.broadcast_from_first_replica(
            self._steps.stage, self.layout, self.global_rank, self._groups.data
        )
        if _lightning.distributed_is_initialized():
            self._pipelined.tie(self.layout, self.global_rank)  # the tied copies start equal
        metrics.metrics_on_last_stage(self.lightning_module, self._groups.last_stage_data, self.is_last_stage)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_optimizers(trainer)
            self._sigterm = SigtermCheck(trainer, self.root_device, _lightning.sigterm_exception(trainer))
            _lightning.set_sigterm_check(trainer, self._sigterm)
        self.setup_precision_plugin()
        precision.install(self.precision_plugin, self._clip_grad_by_norm)
        if trainer.state.fn == TrainerFn.FITTING:
            _lightning.optimizers_to_device(self.optimizers, self.root_device)
        self._metric_sharing = metrics.install_metric_sharing(trainer, self.share_last_stage_metrics)
        piped, replicas, last = self._pipelined, self.layout.replicas, self.is_last_stage
        adapt_callbacks(
            trainer, self._module, self.namespace, piped.name or "", piped.cut_copy, replicas, last,
            piped.whole_model,
        )  # fmt: skip

    def _setup_optimizers(self, trainer: pl.Trainer) -> None:
        with self._pipelined.configuring(self.root_device):  # over this stage's parameters only
            self.setup_optimizers(trainer)
        if len(self.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; the gpipe strategy runs one "
                "forward and one backward per step and supports a single optimizer (use parameter groups)"
            )

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``gradient_clip_algorithm="norm"``: clip by the norm over every stage's gradients together."""
        assert self._groups is not None
        group, tied_groups, norm_type = (
            self._groups.pipeline,
            self._pipelined.tied_groups,
            self.gradient_clip_norm_type,
        )
        self.last_grad_norm = clip_optimizer_gradients(
            optimizer, clip_val, norm_type, group, self.root_device, tied_groups, self.stage_index
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- steps ------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        step, plugin, timeline = super().training_step, self.precision_plugin, self._timeline
        return self._steps.training_step(
            step, self._module, plugin, self.chunks_used, timeline, *args, **kwargs
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.eval_step(super().validation_step, self._module, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.eval_step(super().test_step, self._module, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last stage's predictions, on every stage of its pipeline (:meth:`.StepDriver.predict_step`)."""
        hook, module = super().predict_step, self._module
        return self._steps.predict_step(hook, module, self._from_last_stage, *args, **kwargs)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The user's loss backward (last stage), then every stage's backward drain (:meth:`.StepDriver.drain`)."""
        self.pre_backward(closure_loss)
        module = self._module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        data = self._groups.data if self._groups is not None else None
        self._steps.drain(self.lightning_module, data, self.layout.replicas, self._timeline)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _forward_signal(self, signum: int) -> None:
        """On SIGTERM/SIGINT, the launching rank passes the signal on to the ranks it started."""
        kill = getattr(self._launcher, "kill", None)
        if callable(kill):
            kill(signum)

    # -- lifecycle ---------------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        """With ``timeline=True``: log ``pipeline/bubble`` and write the trace and the Gantt chart (rank 0)."""
        if self._timeline is not None and _lightning.distributed_is_initialized():
            trainer = self._module.trainer
            loggers = trainer.loggers if self.is_global_zero else ()
            self.timeline_records = publish(self._timeline, self.timeline_dir or trainer.log_dir, loggers)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """End every rank promptly, the original error first (:mod:`lightning_gpipe.transport.failure`)."""
        self._failed = True
        if _lightning.distributed_is_initialized():
            report_and_abort(exception, f"stage {self.stage_index} (rank {self.global_rank})")

    def release_groups(self) -> None:
        """Drop every process-group handle this strategy and its module's metrics hold (at exit)."""
        self._groups = None
        metrics.sync_metrics_over(self.lightning_module, None, member=True)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and _lightning.attached_trainer(module) is not None:
            restore_callbacks(module.trainer)
            _lightning.set_sigterm_check(module.trainer, None)
        if self._sigterm is not None and not self._failed:
            self._sigterm.close(self.collective_timeout)
        self._sigterm = None
        metrics.remove_metric_sharing(self.lightning_module, self._metric_sharing)
        self._metric_sharing = None
        self._saved.lazy = None
        if self._pipelined.stage_only:
            # Lightning moves the module to the CPU: first the stage alone, not the other stages' meta layers
            super().teardown()
            unpartition_model(self)
            return
        unpartition_model(self)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _lightning.StrategyRegistry) -> None:
        if "gpipe" not in strategy_registry:
            strategy_registry.register(
                "gpipe", cls, description="GPipe pipeline parallelism (lightning_gpipe)"
            )
        if "gpipe_notebook" not in strategy_registry:
            description = "GPipe pipeline parallelism, ranks forked (Jupyter, python -i)"
            strategy_registry.register("gpipe_notebook", cls, description=description, start_method="fork")


class GPipeStrategy(_GPipeStrategyLogic, ParallelStrategy):
    __doc__ = _GPipeStrategyLogic.__doc__
    namespace = PYTORCH_LIGHTNING


__all__ = ["GPipeStrategy", "PartitionError", "UnsafeCheckpointError"]
