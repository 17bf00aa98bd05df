"""``GPipeStrategy``: the Lightning glue. The pipeline itself lives in :mod:`lightning_gpipe.stage`.

Hook order (Lightning's automatic optimization): ``training_step`` runs the user's step, whose
call of the pipelined Sequential is the forward fill; ``backward`` runs the user's loss backward
on the last stage and then the backward drain on every stage; ``optimizer_step`` steps each
stage's own optimizer on its own parameters.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.strategies import _StrategyRegistry
from lightning_fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning_fabric.utilities.seed import reset_seed
from lightning_fabric.utilities.types import ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_only
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe.balance import balance_by_memory, balance_by_parameters, balance_by_time
from lightning_gpipe.batchnorm import commit_deferred_batch_norm, convert_deferred_batch_norm
from lightning_gpipe.checkpoint import (
    NAMES_KEY,
    PLACEHOLDER,
    SHARDED_KEY,
    add_placeholder_parameter,
    drop_placeholder,
    drop_placeholder_names,
    group_names,
    is_sharded,
    load_sharded,
    merge_optimizer_states,
    save_sharded,
    set_sharded_optimizer_states,
    split_optimizer_state,
    tensors_to_cpu,
)
from lightning_gpipe.comm import P2P, Groups, Layout, close_at_exit, new_groups
from lightning_gpipe.failure import report_and_abort
from lightning_gpipe.gradients import allreduce_gradients, clip_grad_norm_
from lightning_gpipe.launcher import GPipeLauncher
from lightning_gpipe.loading import (
    CHECKPOINT_SOURCE,
    LazyCheckpoint,
    UnsafeCheckpointError,
    copy_into,
    meta_tensors,
    safe,
)
from lightning_gpipe.materialize import global_seed, has_meta, load_layers, materialize_layers
from lightning_gpipe.metrics import (
    ShareLastStageMetrics,
    restore_logging,
    share_last_stage_metrics,
    silence_logging,
    sync_metrics_over,
)
from lightning_gpipe.microbatch import as_tensors, split
from lightning_gpipe.partition import (
    PartitionError,
    check_balance,
    check_stages,
    check_tied_parameters,
    cut,
    find_sequential,
    stage_bounds,
    uniform_balance,
)
from lightning_gpipe.precision import PipelineGradScaler
from lightning_gpipe.skip import routes as skip_routes
from lightning_gpipe.stage import CHECKPOINT_MODES, PipelineStage, StageDone, StageTopology
from lightning_gpipe.timeline import Timeline, publish

log = logging.getLogger(__name__)


BALANCERS = ("uniform", "parameters", "time", "memory")


class GPipeStrategy(ParallelStrategy):
    """GPipe pipeline parallelism (Huang et al. 2019, arXiv 1811.06965) as a Lightning strategy.

    The LightningModule's ``nn.Sequential`` is cut into P consecutive stages, one per process;
    each mini-batch ``(N, *)`` is split into ``chunks × (≈N/chunks, *)`` micro-batches that
    stream through the stages (fill-drain); gradients accumulate over the micro-batches and one
    synchronous optimizer step follows. The result equals training the unpartitioned module on
    the whole mini-batch, up to float reassociation.

    Args:
        chunks: number of micro-batches M per mini-batch (≥ 1).
        balance: layers per stage, e.g. ``[3, 2]``, or how to choose it: ``"uniform"`` (layer
            count), ``"parameters"`` (parameter count per layer), ``"time"`` (profiled forward +
            backward seconds per layer) or ``"memory"`` (profiled activation + parameter bytes per
            layer, parameters counted ``1 + optimizer_state_factor`` times). Profiling runs once,
            on global rank 0, on the stages' device, with one micro-batch of the first training
            batch (or ``example_input_array``); every rank receives the result. The chosen balance
            is logged (``gpipe_balance``) and stored in checkpoints under ``"gpipe"``.
            ``None`` splits as evenly as possible by
            layer count, earlier stages taking the extra layers.
        checkpoint: re-materialization per micro-batch: ``"always"``, ``"except_last"`` (the
            last micro-batch's backward comes first, so it keeps its activations) or ``"never"``.
        module_name: attribute path of the ``nn.Sequential`` to pipeline (e.g. ``"layers"``);
            ``None`` finds the only ``nn.Sequential`` holding every parameter.
        pipeline_parallel_size: stages per pipeline P; the world (``devices × num_nodes``) holds
            ``W / P`` data-parallel replicas. ``None``: P = W.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for any Lightning ``ParallelStrategy``; the Trainer fills them in.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks by device.
        timeout: ``torch.distributed`` timeout for collectives and point-to-point.
        timeline: record every stage's forward/recompute/backward/send/recv spans
            (:mod:`lightning_gpipe.timeline`); at the end of ``fit``, log ``pipeline/bubble`` per
            step and write ``timeline.json`` (Chrome trace) and ``timeline.png`` (Gantt chart).
        timeline_dir: where those files go (default: the trainer's ``log_dir``).
        gradient_clip_norm_type: the norm that ``Trainer(gradient_clip_val=...,
            gradient_clip_algorithm="norm")`` clips by (2.0, or ``float("inf")``), computed over
            the gradients of all stages together, as on one device.
        deferred_batch_norm: BatchNorm layers normalise each micro-batch with its own statistics
            but update their running statistics once per mini-batch, with the whole mini-batch's
            statistics (:mod:`lightning_gpipe.batchnorm`; GPipe section 2.2), so they equal those
            of the unpartitioned model trained on the full batch.
        checkpoint_format: ``"full"``: one standard Lightning checkpoint file, gathered on rank 0
            (the plain module loads it with ``strict=True``; optimizer states merged as one
            optimizer over the whole model). ``"sharded"``: a directory written with
            ``torch.distributed.checkpoint``, each stage its own shard, loadable with any number
            of stages. Both are written atomically.
        weights_only: how checkpoint files are unpickled when ``fit``/``validate``/``test``/
            ``predict`` get ``ckpt_path=``: ``None`` or ``True``, torch's safe unpickler
            (tensors, containers, primitive types; anything else is refused with
            :class:`~lightning_gpipe.loading.UnsafeCheckpointError`, naming the file); ``False``,
            full pickle, which runs whatever the file names (only for files you trust).
            Lightning does not hand ``trainer.fit(weights_only=...)`` to strategies that restore
            after setup, so the opt-in is given here.

    Raises:
        ValueError: at construction, for a bad ``chunks``, ``checkpoint``, ``balance`` or
            ``pipeline_parallel_size``; at ``Trainer`` construction, when the world size is not a
            multiple of ``pipeline_parallel_size``.
        PartitionError: before processes start, when the module cannot be cut as asked.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        chunks: int = 1,
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
        weights_only: bool | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(
                f"chunks must be an integer >= 1 (chunks: {chunks!r}); it is the number of micro-batches"
            )
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint must be one of {', '.join(repr(m) for m in CHECKPOINT_MODES)} (checkpoint: {checkpoint!r})"
            )
        if isinstance(balance, str):
            if balance not in BALANCERS:
                raise ValueError(
                    f"balance must be a list of layers per stage, None, or one of "
                    f"{', '.join(repr(b) for b in BALANCERS)} (balance: {balance!r})"
                )
        elif balance is not None:
            if isinstance(balance, bytes) or not hasattr(balance, "__iter__"):
                raise ValueError(f"balance must be a list of layers per stage or None (balance: {balance!r})")
            bad = [b for b in balance if isinstance(b, bool) or not isinstance(b, int) or b < 1]
            if bad or not list(balance):
                raise ValueError(
                    f"balance entries must be positive integers (balance: {list(balance)!r}); every stage needs a layer"
                )
            balance = list(balance)
        if pipeline_parallel_size is not None and (
            isinstance(pipeline_parallel_size, bool)
            or not isinstance(pipeline_parallel_size, int)
            or pipeline_parallel_size < 1
        ):
            raise ValueError(
                f"pipeline_parallel_size must be an integer >= 1 or None (got {pipeline_parallel_size!r})"
            )
        if (
            isinstance(balance, list)
            and pipeline_parallel_size is not None
            and len(balance) != pipeline_parallel_size
        ):
            raise ValueError(
                f"balance has {len(balance)} stages but pipeline_parallel_size is {pipeline_parallel_size} "
                f"(balance: {balance}); give one entry per stage"
            )
        self.chunks = chunks
        self.balance = balance
        self.checkpoint = checkpoint
        self.module_name = module_name
        self.pipeline_parallel_size = pipeline_parallel_size
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._stage: PipelineStage | None = None
        self._original: tuple[nn.Module, str, nn.Sequential] | None = None  # (parent, attr, full Sequential)
        self._seq_name = ""
        self._lazy_checkpoint: LazyCheckpoint | None = None  # the full checkpoint being restored
        self._stage_only = (
            False  # the Sequential was built on the meta device: each rank holds only its stage
        )
        self._groups: Groups | None = None
        self.gradient_clip_norm_type = float(gradient_clip_norm_type)
        if checkpoint_format not in ("full", "sharded"):
            raise ValueError(
                f"checkpoint_format must be 'full' or 'sharded' (checkpoint_format: {checkpoint_format!r})"
            )
        self.checkpoint_format = checkpoint_format
        self.optimizer_state_factor = float(optimizer_state_factor)
        self.deferred_batch_norm = bool(deferred_batch_norm)
        if weights_only not in (None, True, False):
            raise ValueError(f"weights_only must be None, True or False (weights_only: {weights_only!r})")
        self.weights_only = weights_only
        self._plain_batch_norms: list[tuple[nn.Module, str, nn.Module]] = []
        self.balance_used: list[int] | None = None
        self._failed = False
        self.timeline, self.timeline_dir = timeline, timeline_dir
        self._timeline: Timeline | None = None
        self.timeline_records: list[dict[str, Any]] | None = None  # rank 0, after fit with timeline=True

    # -- topology ------------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layout(self) -> Layout:
        """The rank layout: P stages × D replicas, last stage on each pipeline's lowest rank."""
        world = max(self.num_nodes * self.num_processes, 1)
        return Layout(world, self.pipeline_parallel_size or world)

    @property
    def stage_index(self) -> int:
        return self.layout.stage_of(self.global_rank)

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.layout.stages - 1

    @property
    def is_distributed(self) -> bool:
        """Lightning shards data (and syncs logs) only over data-parallel replicas.

        With one replica every stage must see the user's own batches in the user's order, so
        Lightning must not add a ``DistributedSampler``.
        """
        return self.layout.replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        layout = self.layout
        return {"num_replicas": layout.replicas, "rank": layout.replica_of(self.global_rank)}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        self.layout  # noqa: B018 - validates world size against pipeline_parallel_size before any spawn
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not supported by the gpipe strategy (each stage holds different "
                "layers); use GPipeStrategy(deferred_batch_norm=True) for full-batch running statistics"
            )
        self._launcher = GPipeLauncher(self, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self._groups is None:
            self._groups = new_groups(self.layout, self.global_rank)
        close_at_exit(self)
        if os.environ.get("PL_GLOBAL_SEED") is None:
            # An unseeded script: give every rank rank 0's CPU RNG state, so that a shuffling
            # DataLoader hands every stage of a pipeline the same batches.
            box = [torch.get_rng_state() if self.global_rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            torch.set_rng_state(box[0] if box[0] is not None else torch.get_rng_state())

    # -- the model -------------------------------------------------------------------------------

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``Trainer.init_module`` and ``configure_model`` create tensors.

        ``empty_init=True``, and ``None`` inside ``configure_model`` (which runs on every rank
        once the processes are up): on the meta device; at setup the strategy cuts the meta
        Sequential and materializes only this rank's stage (:mod:`lightning_gpipe.materialize`:
        each layer initialized by its ``reset_parameters()`` from a stream seeded by the global
        seed and the layer's index, the same for any stage count). Otherwise (``False``, or
        ``None`` before the processes start), Lightning's default: on this rank's device.
        The precision plugin's dtype applies either way.
        """
        meta = empty_init is True or (empty_init is None and _distributed_is_initialized())
        if not meta:
            with super().tensor_init_context(empty_init=empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def check_model(self, model: pl.LightningModule) -> tuple[str, nn.Sequential, list[int]]:
        """Find the pipelined Sequential and the balance; raise before any process starts.

        Raises:
            PartitionError: no unique Sequential, parameters outside it, or a balance/stage count
                that does not fit its layers.
        """
        name, seq = find_sequential(model, self.module_name)
        stages = self.layout.stages
        if stages > 1 and not model.automatic_optimization:
            raise ValueError(
                f"{type(model).__name__} uses manual optimization (automatic_optimization = False), which the gpipe "
                "strategy does not support: on every stage but the last, training_step ends at the pipelined call, "
                "before the user's backward and optimizer step; use automatic optimization"
            )
        if isinstance(self.balance, list):
            check_stages(len(seq), len(self.balance))
            balance = check_balance(self.balance, len(seq), stages)
            check_tied_parameters(seq, balance)
        else:
            balance = uniform_balance(len(seq), stages)  # also checks stages against layers
        return name, seq, balance

    def _choose_balance(self, model: pl.LightningModule, seq: nn.Sequential, uniform: list[int]) -> list[int]:
        """Resolve ``balance="parameters" | "time" | "memory"``: rank 0 decides, every rank receives."""
        how, stages = self.balance, self.layout.stages
        if not isinstance(how, str) or how == "uniform":
            return uniform
        if how == "parameters":
            return balance_by_parameters(seq, stages)
        if has_meta(seq):
            raise ValueError(
                f"balance={how!r} profiles the whole model on rank 0, but it was built on the meta device "
                "(Trainer.init_module(empty_init=True) or configure_model) to hold only one stage per rank; "
                "use balance='parameters', 'uniform' or a list of layers per stage"
            )
        chosen: list[int] | None = None
        error: str | None = None
        if self.global_rank == 0:
            try:
                devices = [self.root_device] if self.root_device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):  # profiling leaves the RNG streams as they were
                    chosen = self._profile_balance(model, seq, how, stages)
            except Exception as err:  # every rank must hear of it, or the others would wait forever
                error = f"{type(err).__name__}: {err}"
                raise
            finally:
                self.broadcast((chosen, error))
        else:
            chosen, error = self.broadcast((None, None))
            if error is not None:
                raise RuntimeError(f"balance={how!r}: profiling on rank 0 failed: {error}")
        assert chosen is not None
        return chosen

    def _profile_balance(
        self, model: pl.LightningModule, seq: nn.Sequential, how: str, stages: int
    ) -> list[int]:
        sample = self._sample_micro_batch(model, seq)
        if how == "time":
            return balance_by_time(seq, sample, stages, device=self.root_device)
        factor = self.optimizer_state_factor
        return balance_by_memory(seq, sample, stages, optimizer_factor=factor, device=self.root_device)

    def _sample_micro_batch(self, model: pl.LightningModule, seq: nn.Sequential) -> Any:
        """One micro-batch of what the pipelined Sequential receives: from ``example_input_array``,
        else captured by running the user's ``training_step`` on the first training batch up to
        the Sequential's call.
        """
        sample = model.example_input_array
        if sample is None:
            trainer = model.trainer
            loader = trainer.fit_loop._data_source.dataloader()
            batch = self.batch_to_device(next(iter(loader)))
            captured: list[Any] = []

            def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
                captured.append(args[0])
                raise _Captured

            handle = seq.register_forward_pre_hook(capture)
            silence_logging(model)  # outside the loop, Lightning refuses self.log
            try:
                with torch.no_grad(), contextlib.suppress(_Captured):
                    model.training_step(batch, 0)
            finally:
                handle.remove()
                restore_logging(model)
            if not captured:
                raise ValueError(
                    f"balance={self.balance!r} needs a sample input: training_step did not call the pipelined "
                    "Sequential on the first batch; set LightningModule.example_input_array"
                )
            sample = captured[0]
        tensors, is_tuple = as_tensors(sample, "the sample input for balancing")
        first = split([t.to(self.root_device) for t in tensors], self.chunks)[0]
        return first if is_tuple else first[0]

    def _partition(self) -> None:
        model = self.lightning_module
        assert model is not None
        name, seq, balance = self.check_model(model)
        balance = self._choose_balance(model, seq, balance)
        check_tied_parameters(seq, balance)
        layout = self.layout
        rank, stage = self.global_rank, self.stage_index
        replica = layout.replica_of(rank)
        self._stage_only = has_meta(seq)
        if self._stage_only:
            self._materialize_stage(model, name, seq, balance, stage)
        topology = StageTopology(
            stage=stage,
            stages=layout.stages,
            prev_rank=layout.rank(replica, stage - 1) if stage > 0 else None,
            next_rank=layout.rank(replica, stage + 1) if stage < layout.stages - 1 else None,
            ranks=tuple(layout.pipeline_ranks(replica)),
            skips=tuple(skip_routes(seq, [j for j, n in enumerate(balance) for _ in range(n)])),
        )
        pipe = PipelineStage(
            cut(seq, balance, stage),
            topology,
            self.chunks,
            self.checkpoint,
            P2P(self.root_device),
            list(seq._modules),
        )
        if self.deferred_batch_norm:
            self._plain_batch_norms = [
                (owner, child_name, child)
                for owner in pipe.modules()
                for child_name, child in owner.named_children()
                if isinstance(child, _BatchNorm) and child.track_running_stats
            ]
            convert_deferred_batch_norm(pipe)  # shares parameters and buffers with the originals
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, pipe)
        self._stage, self._original, self._seq_name = pipe, (parent, attr, seq), name
        left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
        if left:
            shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
            raise ValueError(
                f"{len(left)} tensors outside the pipelined nn.Sequential are on the meta device ({shown}); only "
                "the Sequential's layers are materialized per stage: create the rest outside "
                "Trainer.init_module(empty_init=True) and configure_model's layers"
            )
        if self.timeline:
            self._timeline = pipe.timeline = Timeline(stage, layout.stages, rank, replica)
        self.balance_used = balance
        if isinstance(self.balance, str) and self.is_global_zero:
            rank_zero_info(f"gpipe: balance={self.balance!r} chose {balance} (layers per stage)")
            for logger in model.trainer.loggers if model._trainer is not None else ():
                logger.log_hyperparams({"gpipe_balance": balance})
        log.info(f"gpipe: rank {rank} runs stage {stage}/{layout.stages} with layers {list(pipe._modules)}")

    def _materialize_stage(
        self, model: pl.LightningModule, name: str, seq: nn.Sequential, balance: list[int], stage: int
    ) -> None:
        """Give this stage's meta layers real tensors on this rank's device; the other stages' stay meta.

        A module from :func:`lightning_gpipe.load_from_checkpoint` reads them from its checkpoint;
        otherwise each layer is initialized by :func:`lightning_gpipe.materialize.materialize_layers`
        (its ``reset_parameters()``, from a random stream of the global seed and the layer's index).
        """
        layers = cut(seq, balance, stage)
        source = getattr(model, CHECKPOINT_SOURCE, None)
        if source is None:
            start = stage_bounds(balance)[stage][0]
            materialize_layers(
                [(start + j, layer) for j, (_, layer) in enumerate(layers)], global_seed(), self.root_device
            )
            return
        path, weights_only = source
        lazy = LazyCheckpoint(path, weights_only)
        load_layers(layers, name + ".", lazy.data.get("state_dict", {}), lazy.read_into, self.root_device)

    def _unpartition(self) -> None:
        """Put the user's full Sequential back, loaded with every stage's trained state."""
        if self._original is None:
            return
        parent, attr, seq = self._original
        if self._stage is not None:
            self.last_received_skips = list(self._stage.received_skips)
        for owner, child_name, child in self._plain_batch_norms:  # undo the deferred batch norm conversion
            setattr(owner, child_name, child)
        self._plain_batch_norms = []
        if not self._failed and not self._stage_only and _distributed_is_initialized():
            full = self._gather_sequential_state(to_all=True)
            seq.load_state_dict(full)
        setattr(parent, attr, seq)
        self._original, self._stage = None, None

    def _gather_sequential_state(self, to_all: bool) -> dict[str, Tensor]:
        """The pipelined Sequential's full ``state_dict`` (keys relative to it) from replica 0's stages."""
        assert self._stage is not None
        layout = self.layout
        local = {k: v.detach().cpu() for k, v in self._stage.state_dict().items()}
        mine = local if layout.replica_of(self.global_rank) == 0 else {}
        parts: list[Any] = [None] * self.world_size
        if to_all:
            dist.all_gather_object(parts, mine)
        else:
            dist.gather_object(mine, parts if self.global_rank == 0 else None, dst=0)
            if self.global_rank != 0:
                return {}
        full: dict[str, Tensor] = {}
        for part in parts:
            full.update(part)
        return full

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._partition()  # before the optimizers: they only ever see this stage's parameters
        assert self.model is not None and self._stage is not None and self._groups is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.layout.replicas > 1:  # every copy of a stage starts from replica 0's state, as under DDP
            src = self.layout.rank(0, self.stage_index)
            with torch.no_grad():
                for tensor in self._stage.state_dict().values():
                    dist.broadcast(tensor, src=src, group=self._groups.data)
        sync_metrics_over(self.lightning_module, self._groups.last_stage_data, member=self.is_last_stage)
        if not self.is_last_stage:
            silence_logging(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            if not any(True for _ in self._stage.parameters()):
                add_placeholder_parameter(self._stage, self.root_device)
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise ValueError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; the gpipe strategy runs one "
                    "forward and one backward per step and supports a single optimizer (use parameter groups)"
                )
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, PipelineGradScaler):
            self.precision_plugin.scaler = PipelineGradScaler.from_scaler(scaler)  # type: ignore[attr-defined]
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning_fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)
        self._metric_sharing = ShareLastStageMetrics(self.share_last_stage_metrics)
        trainer.callbacks.insert(0, self._metric_sharing)  # type: ignore[attr-defined]

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``gradient_clip_algorithm="norm"``: clip by the norm over every stage's gradients together."""
        assert self._groups is not None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.last_grad_norm = clip_grad_norm_(
            params, float(clip_val), self.gradient_clip_norm_type, self._groups.pipeline, self.root_device
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- steps ------------------------------------------------------------------------------------

    def _run_step(self, hook: Any, expect_backward: bool, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        assert stage is not None
        stage.begin_step(expect_backward)
        try:
            return hook(*args, **kwargs)
        except StageDone:
            return StageDone
        finally:
            stage.end_step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._timeline is not None:
            self._timeline.begin_step(self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        out = self._run_step(super().training_step, True, *args, **kwargs)
        stage = self._stage
        assert stage is not None
        if self.deferred_batch_norm:
            commit_deferred_batch_norm(stage)  # once per mini-batch, after all its micro-batches
        if not stage.ran_forward:
            return out
        return self._share_loss(out)

    def _share_loss(self, out: Any) -> Any:
        """The last stage tells the others whether the step has a loss (and its value).

        Other stages return that value as their step output, so that Lightning calls ``backward``
        on every stage or on none (should a ``training_step`` return ``None``; Lightning itself
        refuses that when several processes run).
        """
        stage = self._stage
        assert stage is not None
        layout = self.layout
        replica = layout.replica_of(self.global_rank)
        if layout.stages == 1:
            return out
        if stage.topology.is_last:
            loss = out.get("loss") if isinstance(out, dict) else out
            has = isinstance(loss, Tensor)
            value = float(loss.detach().float()) if isinstance(loss, Tensor) and loss.numel() == 1 else 0.0
            message = torch.tensor(
                [float(has), value],
                dtype=torch.float64,
                device=self.root_device,
            )
            for s in range(layout.stages - 1):
                stage.p2p.send([message], layout.rank(replica, s))
            if not has:
                stage.p2p.flush()
                stage.backward_skipped()
            # else the backward's own flush waits for these sends: the drain starts now
            return out
        _, (message,) = stage.p2p.recv(layout.rank(replica, layout.stages - 1))
        has, value = message.tolist()
        if not has:
            stage.backward_skipped()
            return None
        return torch.tensor(value, device=self.root_device, requires_grad=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _none_if_done(self._run_step(super().validation_step, False, *args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _none_if_done(self._run_step(super().test_step, False, *args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return _none_if_done(self._run_step(super().predict_step, False, *args, **kwargs))

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The user's loss backward (last stage), then every stage's backward drain."""
        self.pre_backward(closure_loss)
        module = self.lightning_module
        assert module is not None and self._stage is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._stage.backward()
        if self.layout.replicas > 1 and not self._accumulating():
            assert self._groups is not None
            allreduce_gradients(self._stage.parameters(), self._groups.data, self.layout.replicas)
        if self._timeline is not None:
            self._timeline.end_step()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _accumulating(self) -> bool:
        """Whether this backward is followed by another before the optimizer step (gradient accumulation)."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization or module._trainer is None:
            return False
        return module.trainer.fit_loop._should_accumulate()

    # -- collectives ----------------------------------------------------------------------------

    @property
    def last_stage_group(self) -> Any:
        """The data-parallel group of the last stage, where losses and metrics live."""
        return self._groups.last_stage_data if self._groups is not None else None

    def share_last_stage_metrics(self, trainer: pl.Trainer) -> None:
        """Give every stage of each pipeline its last stage's ``trainer.callback_metrics``."""
        layout = self.layout
        if layout.stages == 1 or self._groups is None or not _distributed_is_initialized():
            return
        src = layout.rank(layout.replica_of(self.global_rank), layout.stages - 1)
        share_last_stage_metrics(trainer, src, self._groups.pipeline, self.root_device)

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """Reduce over the last stage's data-parallel replicas (where losses and metrics live)."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        group = group if group is not None else self.last_stage_group
        if group is None or dist.get_world_size(group) == 1:
            return tensor
        from lightning_fabric.utilities.distributed import _sync_ddp

        return _sync_ddp(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if not _distributed_is_initialized():
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return bool(t == self.world_size) if all else bool(t)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the partitioned module, each stage taking its own part."""
        return True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write the checkpoint (``checkpoint_format``), recording the pipeline under ``checkpoint["gpipe"]``."""
        checkpoint["gpipe"] = {
            "balance": self.balance_used,
            "balance_by": self.balance,
            "chunks": self.chunks,
            "stages": self.layout.stages,
        }
        if self.checkpoint_format == "sharded" and _distributed_is_initialized():
            module = self.lightning_module
            assert module is not None
            save_sharded(checkpoint, filepath, module, [_unwrap(o) for o in self.optimizers])
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint file or directory, with torch's safe unpickler unless ``weights_only=False``.

        ``weights_only`` (or, when ``None``, the strategy's ``weights_only``) decides how every
        file is unpickled, the sharded checkpoint's metadata included.

        Raises:
            UnsafeCheckpointError: the safe unpickler refuses the file (the message names it
                and the opt-in).
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        if is_sharded(checkpoint_path):
            module = self.lightning_module
            assert module is not None
            return load_sharded(checkpoint_path, module, [_unwrap(o) for o in self.optimizers], weights_only)
        if not os.path.isfile(
            checkpoint_path
        ):  # a remote path: the CheckpointIO reads it, safely unless opted out
            return super().load_checkpoint(checkpoint_path, weights_only=safe(weights_only))
        lazy = LazyCheckpoint(checkpoint_path, weights_only)
        self._lazy_checkpoint = lazy
        return self._stage_part(lazy)

    def _stage_part(self, lazy: LazyCheckpoint) -> dict[str, Any]:
        """The part of a full checkpoint this rank needs, its model and optimizer tensors not yet read.

        Model tensors of other stages and their optimizer state are dropped unread; this stage's
        stay meta tensors until :meth:`load_model_state_dict` / :meth:`load_optimizer_state_dict`
        read them one at a time; everything else (loops, callbacks, schedulers) is read now.
        """
        checkpoint = dict(lazy.data)
        module = self.lightning_module
        state = checkpoint.pop("state_dict", {})
        optimizer_states = checkpoint.pop("optimizer_states", [])
        checkpoint = lazy.materialize(checkpoint)
        if module is None:
            checkpoint["state_dict"] = state
            checkpoint["optimizer_states"] = optimizer_states
            return checkpoint
        wanted = set(module.state_dict())
        checkpoint["state_dict"] = {k: v for k, v in state.items() if k in wanted}
        mine = {name for name, _ in module.named_parameters()}
        parts = []
        for merged in optimizer_states:
            merged = self._with_names(dict(merged))
            names = merged.get(NAMES_KEY)
            if names is not None:
                merged["state"] = {i: v for i, v in merged.get("state", {}).items() if names[i] in mine}
            parts.append({k: (v if k == "state" else lazy.materialize(v)) for k, v in merged.items()})
        checkpoint["optimizer_states"] = parts
        return checkpoint

    def _with_names(self, merged: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state with its parameter names: a plain one-device one gets them in model order."""
        if (
            NAMES_KEY not in merged
            and len(merged.get("param_groups", ())) == 1
            and self._original is not None
        ):
            # a plain one-device checkpoint: one group over every parameter, in model order
            prefix = self._seq_name + "."
            merged[NAMES_KEY] = [prefix + n for n, _ in self._original[2].named_parameters()]
        return merged

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The user's full ``state_dict`` (original parameter names) on rank 0, gathered from all stages."""
        module = self.lightning_module
        assert module is not None
        if self.checkpoint_format == "sharded":
            return {}  # each stage writes its own shard in save_checkpoint
        if self._stage is None and has_meta(module):
            raise RuntimeError(
                f"{type(module).__name__} was built on the meta device and each rank holds only its own stage "
                "outside fit/validate/test; save checkpoints while the trainer runs (ModelCheckpoint, or "
                "trainer.save_checkpoint from a callback)"
            )
        if self._stage is None or not _distributed_is_initialized():
            return module.state_dict()
        full = self._gather_sequential_state(to_all=False)
        if self.global_rank != 0:
            return {}
        prefix = self._seq_name + "."
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(prefix)}
        state.update({prefix + k: v for k, v in full.items()})
        return state

    def _names_by_id(self) -> dict[int, str]:
        module = self.lightning_module
        assert module is not None
        return {id(p): name for name, p in module.named_parameters()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """On rank 0: one optimizer ``state_dict`` over the whole model, merged from every stage.

        It has the layout a single optimizer over the plain module's parameters would have (see
        :mod:`lightning_gpipe.checkpoint`), plus the parameter names, so it loads back into any
        number of stages. Every rank takes part (a gather from replica 0's stages).
        """
        optimizer = _unwrap(optimizer)
        if self.checkpoint_format == "sharded":
            return {}  # each stage writes its own shard in save_checkpoint
        names = group_names(optimizer, self._names_by_id(), missing=PLACEHOLDER)
        layout = self.layout
        mine = (self.stage_index, tensors_to_cpu(optimizer.state_dict()), names)
        parts: list[Any] = [mine]
        if _distributed_is_initialized() and self.world_size > 1:
            parts = [None] * self.world_size
            dist.gather_object(
                mine if layout.replica_of(self.global_rank) == 0 else None,
                parts if self.global_rank == 0 else None,
                dst=0,
            )
            if self.global_rank != 0:
                return {}
        stages = sorted((p for p in parts if p is not None), key=lambda p: p[0])
        return merge_optimizer_states(
            [(drop_placeholder(sd, n), drop_placeholder_names(n)) for _, sd, n in stages]
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Give each stage's optimizer its part of the merged optimizer states (matched by parameter name)."""
        from lightning_fabric.utilities.optimizer import _optimizer_to_device

        if checkpoint.get(SHARDED_KEY):
            module = self.lightning_module
            assert module is not None
            set_sharded_optimizer_states(
                module, [_unwrap(o) for o in self.optimizers], checkpoint["optimizer_states"]
            )
            return
        names_by_id = self._names_by_id()
        lazy = self._lazy_checkpoint
        for optimizer, merged in zip(self.optimizers, checkpoint["optimizer_states"]):
            merged = self._with_names(dict(merged))
            names = group_names(optimizer, names_by_id, missing=PLACEHOLDER)
            local = split_optimizer_state(merged, names, stateless=lambda name: PLACEHOLDER in name)
            if lazy is not None:
                local["state"] = {i: lazy.materialize(v) for i, v in local["state"].items()}
            optimizer.load_state_dict(local)
            _optimizer_to_device(optimizer, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a full checkpoint into the full or the partitioned module (keeping this stage's keys)."""
        module = self.lightning_module
        assert module is not None
        state = checkpoint["state_dict"]
        if self._stage is not None:
            wanted = set(module.state_dict())
            state = {k: v for k, v in state.items() if k in wanted}
        lazy = self._lazy_checkpoint
        if lazy is not None and any(True for _ in meta_tensors(state)):
            # this stage's tensors, read from the file one at a time straight into the module's
            target = module.state_dict()
            copy_into(
                target if strict else {k: v for k, v in target.items() if k in state}, state, lazy.read_into
            )
            return
        module.load_state_dict(state, strict=strict)

    # -- lifecycle ---------------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        """With ``timeline=True``: log ``pipeline/bubble`` and write the trace and the Gantt chart (rank 0)."""
        if self._timeline is not None and _distributed_is_initialized():
            trainer = self.lightning_module.trainer  # type: ignore[union-attr]
            self.timeline_records = publish(
                self._timeline,
                self.timeline_dir or trainer.log_dir,
                trainer.loggers if self.is_global_zero else (),
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """End every rank promptly, the original error first (:mod:`lightning_gpipe.failure`)."""
        self._failed = True
        if _distributed_is_initialized():
            report_and_abort(exception, f"stage {self.stage_index} (rank {self.global_rank})")

    def release_groups(self) -> None:
        """Drop every process-group handle this strategy and its module's metrics hold (at exit)."""
        self._groups = None
        sync_metrics_over(self._lightning_module, None, member=True)

    @override
    def teardown(self) -> None:
        sharing = getattr(self, "_metric_sharing", None)
        module = self.lightning_module
        if sharing is not None and module is not None and module._trainer is not None:
            callbacks = module.trainer.callbacks  # type: ignore[attr-defined]
            if sharing in callbacks:
                callbacks.remove(sharing)
        restore_logging(module)
        self._lazy_checkpoint = None
        if (
            self._stage_only
        ):  # Lightning moves the module to the CPU: the stage, not the other stages' meta layers
            super().teardown()
            self._unpartition()
            return
        self._unpartition()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "gpipe" not in strategy_registry:
            strategy_registry.register(
                "gpipe", cls, description="GPipe pipeline parallelism (lightning_gpipe)"
            )


class _Captured(BaseException):  # noqa: N818 - control flow, not an error
    """Stops the user's training_step once the sample input is captured."""


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, pl.core.optimizer.LightningOptimizer) else optimizer


def _none_if_done(out: Any) -> Any:
    return None if out is StageDone else out


__all__ = ["GPipeStrategy", "PartitionError", "UnsafeCheckpointError"]
