"""``GPipeStrategy``: the Lightning glue, each hook in the class body, its work in the modules beside it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe import _lightning, errors, state
from lightning_gpipe.engine.rng import share_rng_state
from lightning_gpipe.partition.compiling import check_compile
from lightning_gpipe.state import loading, materialize
from lightning_gpipe.strategy import callbacks, checkpoints, launcher, metrics, microstep, pipelined

from lightning_gpipe.strategy import optimizer_setup, precision, process_group, signals, steps  # isort: skip
from lightning_gpipe.strategy import gradients, heap, tensor_parallel, whole_model  # isort: skip
from lightning_gpipe.strategy._namespace import PYTORCH_LIGHTNING, adopt, namespace_of, register_names
from lightning_gpipe.strategy.pipelined import Pipelined, StageSpec, check_arguments, partition_model
from lightning_gpipe.tools.timeline import Timeline
from lightning_gpipe.tools.trace import publish
from lightning_gpipe.transport import Layout, arrival, groups, mesh

if TYPE_CHECKING:  # the logic is typed as the pytorch_lightning strategy it becomes
    _Base = ParallelStrategy
else:
    _Base = object


class _GPipeStrategyLogic(_Base):
    """GPipe pipeline parallelism (Huang et al. 2019, arXiv 1811.06965) as a Lightning strategy.

    The logic, with no Lightning base: ``GPipeStrategy`` adds one; :mod:`._namespace`, the other namespace's.

    Args (the README's "Arguments" and the docs pages it links say more):
        chunks: micro-batches M per mini-batch (≥ 1); ``None``: 4·K (K stages); ≤ N (see batch_norm).
        balance: layers per stage (``[3, 2]``), ``None`` (even) or a balancer's name (:mod:`.balance_spec`).
        checkpoint: re-materialization per micro-batch: ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: ``"gpipe"`` (``training_step`` per batch), ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``.
        virtual_stages: virtual stages per stage v (``None``: 2 under ``"interleaved_1f1b"``, else 1).
        module_name: the Sequential's path (``None``: found); plan: the parts in call order (:mod:`.plan`).
        *_parallel_size: K·D·T = W (mesh); data_parallel: ``"replicate"`` or ``"fsdp"`` (:mod:`.sharding`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: the Trainer's.
        process_group_backend, timeout: ``"gloo"``/``"nccl"`` (``None``: by device), its timeout.
        timeline, timeline_dir: record every stage's spans, log ``pipeline/bubble``, write a trace there.
        gradient_clip_norm_type: the norm ``gradient_clip_val`` clips by, over all stages together.
        checkpoint_format: ``"full"`` (one Lightning checkpoint file) or ``"sharded"`` (one shard per stage).
        optimizer_state_factor: optimizer state per parameter (2.0: Adam), for ``balance="memory"``.
        batch_norm: ``"batch"`` (training BatchNorm under M > 1 refused) or ``"micro_batch"`` (GPipe's).
        deferred_batch_norm: BatchNorm running statistics once per mini-batch (outputs stay per micro-batch).
        collective_timeout: seconds a rank waits for the others at a collective before failing.
        compile: ``torch.compile`` every stage after the cut: ``True`` or a dict of its arguments.
        start_method: ``"popen"`` (the other ranks re-run the script) or ``"fork"`` (``"gpipe_notebook"``).
        weights_only: how ``ckpt_path=`` files are unpickled: ``None``/``True`` safely, ``False`` full pickle.
        signal_grace: seconds a rank may run on after SIGTERM/SIGINT (to the step boundary, on_exception).

    Raises:
        ValueError: a bad argument; at ``Trainer`` construction, a world size other than K·D·T.
        PartitionError: before processes start, when the module cannot be cut as asked.
    """

    strategy_name = "gpipe"
    restore_checkpoint_after_setup = True  # checkpoints load into the partitioned module, each stage its part
    namespace: str  # "pytorch_lightning" or "lightning" (lightning_gpipe.strategy._namespace)

    def __init__(
        self,
        chunks: int | None = None, balance: list[int] | str | None = None, checkpoint: str = "except_last",
        module_name: str | None = None, pipeline_parallel_size: int | None = None, plan: Any = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None, process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout, timeline: bool = False,
        timeline_dir: str | None = None, gradient_clip_norm_type: float = 2.0, batch_norm: str = "batch",
        checkpoint_format: str = "full", optimizer_state_factor: float = 2.0,
        deferred_batch_norm: bool = False, collective_timeout: float = 30.0,
        compile: bool | dict[str, Any] = False, start_method: str = "popen", weights_only: bool | None = None,
        schedule: str = "gpipe", virtual_stages: int | None = None, signal_grace: float = 30.0,
        data_parallel_size: int | str | None = None, tensor_parallel_size: int | str | None = None,
        data_parallel: str = "replicate",
    ) -> None:  # fmt: skip
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        sizes = mesh.check(pipeline_parallel_size, data_parallel_size, tensor_parallel_size, data_parallel)
        self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size = sizes[:3]
        args = check_arguments(chunks, balance, checkpoint, schedule, virtual_stages, sizes[0], batch_norm)
        self.chunks, self.balance, self.checkpoint, self.schedule, self.virtual_stages, self.batch_norm = args
        self.checkpoint_format, self.module_name = state.check_format(checkpoint_format), module_name
        self.gradient_clip_norm_type, self.compile = float(gradient_clip_norm_type), check_compile(compile)
        self.optimizer_state_factor, self.data_parallel = float(optimizer_state_factor), sizes[3]
        self.deferred_batch_norm = errors.check_flag("deferred_batch_norm", deferred_batch_norm)
        self.signal_grace = signals.check_grace(signal_grace)
        self.collective_timeout = arrival.check_collective_timeout(collective_timeout)
        self.weights_only = loading.check_weights_only(weights_only)
        self.timeline, self.timeline_dir, self.plan = timeline, timeline_dir, pipelined.check_plan(plan)
        self.timeline_records: list[dict[str, Any]] | None = None  # rank 0, after fit with timeline=True
        self.last_grad_norm: Tensor | None = None  # total gradient norm before the last clip (inspection)
        self.process_group_backend = process_group_backend  # chosen by device at set-up when None
        self._timeout, self._failed, self.num_nodes = timeout, False, 1  # num_nodes: set by the Trainer
        self._pipelined = Pipelined()  # this rank's stage in the module, from setup to teardown
        self._groups: groups.Groups | None = None
        self._metric_sharing: metrics.ShareLastStageMetrics | None = None
        self._timeline: Timeline | None = None
        self._sigterm: signals.SigtermCheck | None = None  # Lightning's per-step SIGTERM broadcast, deferred
        self._lazy: loading.LazyCheckpoint | None = None  # the full checkpoint file being restored
        self.start_method = launcher.check_start_method(start_method)
        self._micro_steps = microstep.MicroSteps() if schedule != "gpipe" else None  # a call per micro-batch

    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        """Set by the Trainer's connector first: the strategy takes the class of the Trainer's namespace."""
        adopt(self, namespace_of(accelerator))
        self._accelerator = accelerator

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
        """The rank layout: K stages × D replicas × T, last stage on each pipeline's lowest rank."""
        sizes = (self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size)
        return mesh.layout_of(max(self.num_nodes * self.num_processes, 1), *sizes)

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` over pipeline, data and tensor parallel ranks (:mod:`.mesh`); from setup."""
        return getattr(self._groups, "mesh", None)

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
        """Data (and logs) are sharded over data-parallel replicas only: one, no ``DistributedSampler``."""
        return self.layout.replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.replicas, "rank": self.layout.replica_of(self.global_rank)}

    @property
    def balance_used(self) -> list[int] | None:
        """The balance the stages were cut with (layers per stage); ``None`` before setup."""
        return self._pipelined.balance

    @property
    def last_received_skips(self) -> list[tuple[str, int]] | None:
        """``(skip, source stage)`` pairs this stage received, kept at teardown (inspection)."""
        return self._pipelined.received_skips

    @property
    def _module(self) -> pl.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def _stage_spec(self) -> StageSpec:
        return StageSpec.of(self)

    @override
    def _configure_launcher(self) -> None:
        self.layout  # noqa: B018 - validates world size against pipeline_parallel_size before any spawn
        self._launcher = launcher.new_launcher(self)

    def set_world_ranks(self) -> None:
        env, processes = self.cluster_environment, self.num_processes
        launcher.set_world_ranks(env, self.node_rank, self.local_rank, processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        args = (self.cluster_environment, self.process_group_backend, self._timeout, self.root_device)
        self.process_group_backend = process_group.connect(*args, self.layout)  # and the heartbeat
        share_rng_state(self.global_rank)  # a shuffling DataLoader draws alike on every rank
        self._groups = self._groups or groups.new_groups(self.layout, self.global_rank, self.root_device.type)
        _lightning.set_device_mesh(self.lightning_module, self._groups.mesh)  # LightningModule.device_mesh
        groups.close_at_exit(self)
        signals.watch(self._launcher, self.signal_grace)  # the signal passed on to the ranks this one started

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``init_module`` and ``configure_model`` create tensors (:func:`.tensor_init_context`)."""
        with materialize.tensor_init_context(super().tensor_init_context, self.precision_plugin, empty_init):
            yield

    def check_model(self, model: pl.LightningModule) -> tuple[str, nn.Sequential, list[int]]:
        """Raise before any process starts if the model cannot be cut or run (:meth:`.check_model`)."""
        tensor_parallel.check_model(model, self.layout.tensors)  # T > 1 needs the user's plan
        return self._pipelined.check_model(model, self._stage_spec, self.layout.stages)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Put this rank's stage in the module, then set up its optimizer, the precision and the callbacks."""
        self._place_stage(trainer)  # before the optimizers: they only ever see this stage's parameters
        self._sigterm = signals.defer_sigterm_check(trainer, self.root_device)  # signals stop at a step
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            heap.keep_freed_memory(self.root_device)  # a CPU stage re-faults no freed memory per micro-batch
        self.setup_precision_plugin()
        precision.install(self.precision_plugin, self._clip_grad_by_norm)
        if trainer.state.fn == TrainerFn.FITTING:
            _lightning.optimizers_to_device(self.optimizers, self.root_device)
        self._attach_to_trainer(trainer)

    def _place_stage(self, trainer: pl.Trainer) -> None:
        """Set up the accelerator, then put this rank's stage in the Sequential's place, equal on replicas."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        layout, rank, lanes = self.layout, self.global_rank, getattr(self._groups, "lanes", None)
        args = (self._stage_spec, layout, rank, self.root_device, lanes, self.broadcast, self.batch_to_device)
        self._timeline = partition_model(self._pipelined, self._module, *args)
        assert self.model is not None and self._groups is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._pipelined.start_equal(layout, rank, self._groups, self._module, self._stage_spec)
        metrics.metrics_on_last_stage(self.lightning_module, self._groups.last_stage_data, self.is_last_stage)

    def _attach_to_trainer(self, trainer: pl.Trainer) -> None:  # undone by _detach_from_trainer
        piped, replicas, last = self._pipelined, self.layout.replicas, self.is_last_stage
        self._metric_sharing = metrics.install_metric_sharing(trainer, self.share_last_stage_metrics, last)
        callbacks.adapt_callbacks(trainer, self._module, self.namespace, piped, replicas, last)
        whole_model.attach(self.precision_plugin, self._module, piped, self._groups, self._arrive)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """``configure_optimizers`` over this stage's parameters only; one optimizer, agreed by every rank."""
        setup, configuring = functools.partial(super().setup_optimizers, trainer), self._pipelined.configuring
        optimizer_setup.setup_single_optimizer(self, setup, configuring(self.root_device))

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``gradient_clip_algorithm="norm"``: clip by the norm over every stage, shard and tensor rank."""
        assert self._groups is not None
        tied, sharded = self._pipelined.tied_groups, self._pipelined.sharded is not None
        args = (self.gradient_clip_norm_type, self._groups, self.root_device, tied, self.stage_index, sharded)
        self.last_grad_norm = gradients.clip_optimizer_gradients(optimizer, clip_val, *args)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's step over the stage (the forward fill), then its outcome (:func:`.training_step`)."""
        step, stage, module = super().training_step, self._pipelined.running, self._module
        if self._timeline is not None:
            self._timeline.begin_step(module.trainer.global_step)
        run = functools.partial(stage.run_step, step, True)
        if self._micro_steps is not None:  # one call per micro-batch (lightning_gpipe.strategy.microstep)
            plugin, chunks = self.precision_plugin, self.chunks_used
            run = functools.partial(self._micro_steps.training_step, step, stage, module, plugin, chunks)
        return steps.training_step(self._pipelined, run, module, self.deferred_batch_norm, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.eval_step(self._pipelined, super().validation_step, self._module, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.eval_step(self._pipelined, super().test_step, self._module, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last stage's predictions, on every stage of its pipeline (:func:`.steps.predict_step`)."""
        hook, module = super().predict_step, self._module
        return steps.predict_step(self._pipelined, hook, module, self._from_last_stage, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kw: Any) -> Tensor:
        """The user's loss backward (last stage), then every stage's backward drain (:func:`.steps.drain`)."""
        self.pre_backward(closure_loss)
        module, plugin = self._module, self.precision_plugin
        closure_loss = plugin.pre_backward(closure_loss, module)
        plugin.backward(closure_loss, module, optimizer, *args, **kw)
        data, replicas = getattr(self._groups, "data", None), self.layout.replicas
        steps.drain(self._pipelined, self._micro_steps, self.lightning_module, data, replicas, self._timeline)
        closure_loss = plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _arrive(self, operation: str, ranks: list[int] | None = None) -> None:
        """Wait at ``operation`` for every rank; after ``collective_timeout`` s, fail naming the missing."""
        arrival.arrive(operation, self.collective_timeout, ranks)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        groups.arrive_all(f"barrier {name!r}" if name else "barrier", self.collective_timeout)
        groups.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        groups.arrive_all("broadcast", self.collective_timeout)
        return groups.broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Tensor, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Reduce over the last stage's data-parallel replicas (where losses and metrics live)."""
        group = group if group is not None else getattr(self._groups, "last_stage_data", None)
        return process_group.reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's
        groups.arrive_all("reduce_boolean_decision", self.collective_timeout)
        return groups.all_agree(decision, self.root_device, everyone=all)

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` of this pipeline's last stage, on every stage of the pipeline (tensors on CPU)."""
        pipeline = self._groups.pipeline if self._groups is not None else None
        return groups.from_last_stage(obj, self.layout, self.global_rank, pipeline)

    def share_last_stage_metrics(self, trainer: pl.Trainer) -> None:
        """Give every stage of each pipeline its last stage's ``trainer.callback_metrics``."""
        if self._groups is not None:
            group, layout, rank = self._groups.pipeline, self.layout, self.global_rank
            metrics.share_over_pipeline(trainer, layout, rank, group, self.root_device, self._arrive)

    def share_evaluation_results(self, results: Any, trainer: Any) -> Any:
        """``trainer.validate``/``test``'s return value: the last stage's, on every stage of its pipeline."""
        return metrics.evaluation_results(results, trainer, self._from_last_stage)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the checkpoint (``checkpoint_format``), the pipeline recorded in ``checkpoint["gpipe"]``."""
        record = (self.balance_used, self.balance, self.chunks_used, self.layout.stages, self.virtual_stages)
        checkpoint["gpipe"] = checkpoints.pipeline_record(*record)
        io = (self.checkpoint_io, self.global_rank, storage_options, self._pipelined.tied_aliases())
        if checkpoints.save(self.checkpoint_format, checkpoint, filepath, self._module, self.optimizers, *io):
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's part of a checkpoint (:func:`.checkpoints.load`); ``weights_only=None``: ours."""
        weights_only = self.weights_only if weights_only is None else weights_only
        args = (self._pipelined, self.lightning_module, self.optimizers, super().load_checkpoint)
        loaded, self._lazy = checkpoints.load(checkpoint_path, weights_only, *args)
        return loaded

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The user's full ``state_dict`` (original parameter names) on rank 0, gathered from all stages."""
        layout, rank, fmt = self.layout, self.global_rank, self.checkpoint_format
        return checkpoints.model_state(fmt, self._pipelined, self._module, layout, rank, self._arrive)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """On rank 0: one optimizer ``state_dict`` over the whole model (:func:`.merged_optimizer_state`)."""
        layout, rank, piped, fmt = self.layout, self.global_rank, self._pipelined, self.checkpoint_format
        return checkpoints.optimizer_state(fmt, piped, optimizer, self._module, layout, rank, self._arrive)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Give each stage's optimizer its part of the merged optimizer states (matched by parameter name)."""
        args = (checkpoint, self._module, self.optimizers, self.root_device)
        checkpoints.load_optimizer_states(self._pipelined, self._lazy, *args)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a full checkpoint into the full or the partitioned module (keeping this stage's keys)."""
        checkpoints.load_model_state(self._pipelined, self._lazy, self._module, checkpoint, strict)

    @override
    def on_train_end(self) -> None:
        """With ``timeline=True``: log ``pipeline/bubble``, write the trace and the Gantt chart (rank 0)."""
        if self._timeline is not None and _lightning.distributed_is_initialized():
            trainer = self._module.trainer
            loggers = trainer.loggers if self.is_global_zero else ()
            self.timeline_records = publish(self._timeline, self.timeline_dir or trainer.log_dir, loggers)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A stop on a signal ends quietly; a failure ends every rank promptly, the original error first."""
        self._failed = True
        signals.end_rank(exception, self._sigterm, self.layout, self.global_rank)
        _lightning.clear_device_meshes()  # the module's mesh ends with the groups the failure tears down

    def release_groups(self) -> None:
        """Drop every process-group handle this strategy and its module's metrics hold (at exit)."""
        self._groups = None
        metrics.sync_metrics_over(self.lightning_module, None, member=True)
        _lightning.clear_device_meshes()  # a mesh holds its groups

    @override
    def teardown(self) -> None:
        """Undo what setup attached to the trainer and put the user's whole Sequential back, trained."""
        self._detach_from_trainer()
        gather = not self._failed and _lightning.distributed_is_initialized()  # every stage's trained state
        piped, layout, rank = self._pipelined, self.layout, self.global_rank
        uninstall = functools.partial(piped.uninstall, layout, rank, self._arrive, gather=gather)
        if piped.stage_only:  # Lightning moves the module to the CPU: the stage alone, not the meta layers
            super().teardown()
            uninstall()
        else:
            uninstall()
            super().teardown()

    def _detach_from_trainer(self) -> None:  # and forget the checkpoint file restored from
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module) if module is not None else None
        callbacks.restore_callbacks(trainer)
        signals.restore_sigterm_check(trainer, self._sigterm, self._failed, self.collective_timeout)
        metrics.remove_metric_sharing(module, self._metric_sharing)
        self._sigterm, self._metric_sharing, self._lazy = None, None, None

    register_strategies = classmethod(register_names)  # "gpipe", "gpipe_notebook" (:func:`.register_names`)


class GPipeStrategy(_GPipeStrategyLogic, ParallelStrategy):
    __doc__ = _GPipeStrategyLogic.__doc__
    namespace = PYTORCH_LIGHTNING


__all__ = ["GPipeStrategy"]
