"""The user's Sequential while it is pipelined: this rank's stage in its place, from setup to teardown.

At setup the strategy cuts the LightningModule's ``nn.Sequential`` and puts this rank's
:class:`~lightning_gpipe.engine.stage.PipelineStage` where it was (:meth:`Pipelined.install`); after
``fit`` (or ``validate``/``test``/``predict``) the whole Sequential is back, loaded with every
stage's trained state (:meth:`Pipelined.uninstall`). Between the two, :class:`Pipelined` holds
what that life needs: the installed stage and the balance it was cut with, the parameters that
layers on different stages share (:mod:`lightning_gpipe.partition.tied`), the user's ``torch.compile``
wrappers taken off to cut the Sequential (back after ``fit``), whether the model was built on the
meta device (each rank holds only its stage, :mod:`lightning_gpipe.state.materialize`), and the names by
which saved state is translated between the stage and the whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gpipe import state
from lightning_gpipe._compat import children
from lightning_gpipe._lightning import distributed_is_initialized
from lightning_gpipe.engine.recompute import check_mode
from lightning_gpipe.engine.stage import PipelineStage, PipelineUsageError
from lightning_gpipe.errors import check_count
from lightning_gpipe.partition import compiling, lazy, plan, tied
from lightning_gpipe.partition import cut as partition
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.partition.plan import check_plan
from lightning_gpipe.partition.plan_chain import PlanChain, Step
from lightning_gpipe.partition.plan_forward import PlanForward
from lightning_gpipe.schedule import SCHEDULES, check_schedule, check_virtual_stages
from lightning_gpipe.state.materialize import check_nothing_meta, check_stage_only_balance, has_meta
from lightning_gpipe.state.start_state import start_stage
from lightning_gpipe.strategy import batch_norm, microstep, sharding, tensor_parallel
from lightning_gpipe.strategy.balance_spec import check_balance_spec, choose_balance, log_choice, profiled
from lightning_gpipe.strategy.batch_norm import check_batch_norm
from lightning_gpipe.strategy.tensor_parallel import unparallelize
from lightning_gpipe.tools.timeline import Timeline
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.p2p import Lanes

__all__ = ["Pipelined", "StageSpec", "check_arguments", "check_plan", "partition_model"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """What the strategy's arguments ask of the cut and of the stage, as they stand at set-up.

    Every field is ``GPipeStrategy``'s argument of the same name, except ``chunks``: the
    micro-batches M used (``GPipeStrategy.chunks_used``), and ``plan``: checked
    (:func:`lightning_gpipe.partition.plan.check_plan`).
    """

    module_name: str | None
    balance: list[int] | str | None
    chunks: int
    checkpoint: str
    schedule: str
    virtual_stages: int
    deferred_batch_norm: bool
    compile: bool | dict[str, Any]
    optimizer_state_factor: float
    timeline: bool
    plan: list[Step] | None = None
    data_parallel: str = "replicate"
    batch_norm: str = "batch"

    @classmethod
    def of(cls, strategy: Any) -> StageSpec:
        """``strategy``'s arguments as they stand, ``chunks`` its ``chunks_used``."""
        named = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(cls) if f.name != "chunks"}
        return cls(chunks=strategy.chunks_used, **named)


class Pipelined:
    """One rank's stage installed in the user's LightningModule, and what it takes to put the Sequential back.

    Attributes:
        stage: this rank's stage, installed in the module (``None`` outside setup–teardown).
        installed: where the stage replaced the user's Sequential (:class:`.partition.Installed`).
        index: this rank's stage index ``j``.
        balance: layers per stage the Sequential was cut with (``None`` before the first cut).
        tied: parameters shared by layers on different stages
            (:func:`lightning_gpipe.partition.tied.find_tied`).
        tied_groups: their process groups, once the processes are connected (:meth:`tie`).
        stage_only: the Sequential was built on the meta device; this rank materialized only its stage.
        sharded: the stage wrapped with FSDP2 (``data_parallel="fsdp"``, :mod:`.sharding`), else ``None``.
        received_skips: ``(skip, source stage)`` the stage received, kept at :meth:`uninstall` (inspection).
    """

    def __init__(self) -> None:
        self.stage: PipelineStage | None = None
        self.installed: partition.Installed | None = None
        self.index = 0
        self.balance: list[int] | None = None
        self.stages = 1  # K: with virtual stages the balance has K·v entries
        self.tied: list[tied.Tied] = []
        self.tied_groups: tied.TiedGroups | None = None
        self.stage_only = False
        self.sharded: sharding.ShardedStage | None = None
        self.received_skips: list[tuple[str, int]] | None = None
        self._uncompiled: list[
            tuple[nn.Module, str, Any]
        ] = []  # the user's compiled wrappers, back after fit
        self._user_compile: Any = None  # compiles a stage like the user's torch.compile of the Sequential
        self._plain_names: list[str] | None = None  # taken at install, while the model's ties hold
        self._prefix = ""  # what the model's keys of the pipelined part start with
        self._hooks: list[Any] = []  # the stage's BatchNorm refusals (batch_norm.refusals), off at uninstall

    @property
    def running(self) -> PipelineStage:
        """The installed stage (from setup to teardown)."""
        assert self.stage is not None, "the stage exists from setup to teardown"
        return self.stage

    @property
    def name(self) -> str | None:
        """The Sequential's attribute path in the module (e.g. ``"layers"``), while the stage is installed."""
        return self.installed.name if self.installed is not None else None

    def check_model(
        self, model: nn.Module, spec: StageSpec, stages: int
    ) -> tuple[str, nn.Sequential, list[int]]:
        """Raise before any process starts if the model cannot be cut into ``stages`` stages as ``spec`` says
        (:func:`.partition.check_model`), cannot run its schedule (:func:`.microstep.check_model`) or
        holds lazy layers not yet called (:func:`.partition.lazy.check_initialized`).

        A ``torch.compile``-d Sequential is replaced by the Sequential itself first
        (:func:`.compiling.uncompile`); each stage is compiled with the user's settings instead.
        With ``virtual_stages`` v > 1 it is cut into ``stages × v`` parts, and a skip connection
        between two parts is refused (:func:`.partition.check_skips_within_parts`). With ``spec.plan``
        the model's named parts are cut instead (:func:`lightning_gpipe.partition.plan.check_model`).
        """
        microstep.check_model(model, spec.schedule)
        lazy.check_initialized(model)  # a lazy layer's parameters have no shape yet
        v = spec.virtual_stages
        check_virtual_stages(spec.schedule, v, stages)  # interleaving needs two or more stages
        undone, user_compile = compiling.uncompile(model)
        if undone:
            self._uncompiled += undone
            self._user_compile = user_compile
        seq: nn.Sequential
        if spec.plan is not None:
            if spec.plan[0][1] is not None and (spec.compile or spec.balance in ("time", "memory")):
                raise ValueError(
                    f"compile={spec.compile!r}, balance={spec.balance!r}: a dict plan (parts that pass named "
                    "tensors) is not compiled or profiled; use compile=False and balance='parameters', "
                    "'uniform' or a list, or give plan as a list of parts"
                )
            name, seq, checked = plan.check_model(model, spec.plan, spec.module_name, spec.balance, stages, v)
        else:
            name, seq, checked = partition.check_model(model, spec.module_name, spec.balance, stages, v)
        if v > 1:
            partition.check_skips_within_parts(seq, checked)
        sharding.check_ties(seq, spec.data_parallel, checked, stages)
        return name, seq, checked

    def install(
        self,
        model: nn.Module,
        checked: tuple[str, nn.Sequential, list[int]],
        spec: Any,
        layout: Layout,
        rank: int,
        device: Any,
        choose: Callable[[nn.Sequential, list[int]], list[int]],
        build: Callable[[nn.Sequential, list[int]], PipelineStage],
        deferred_batch_norm: bool = False,
        compile: bool | dict[str, Any] = False,
        data_parallel: str = "replicate",
    ) -> PipelineStage:
        """Cut the user's Sequential and put this rank's stage in its place; return the stage.

        Args:
            checked: ``(name, sequential, balance)`` from :meth:`check_model`.
            spec: the strategy's ``balance=`` (a list, a balancer's name or ``None``).
            choose: ``(sequential, balance) -> balance``: the balance the stages are cut with
                (:func:`lightning_gpipe.strategy.balance_spec.choose_balance`).
            build: ``(sequential, balance) -> stage``: this rank's stage of the cut Sequential.
            deferred_batch_norm, compile, data_parallel: as ``GPipeStrategy``'s arguments.

        Raises:
            PartitionError: parameters shared by layers on different stages are buffers; under
                ``data_parallel="fsdp"`` a parameter shared by two virtual stages of one stage
                (:func:`.sharding.check_ties`, the chosen balance).
            ValueError: a model built on the meta device with a balancer that measures it.
        """
        name, seq, balance = checked
        self.stage_only = has_meta(seq)
        if self.stage_only:
            check_stage_only_balance(spec)
        balance = choose(seq, balance)
        partition.check_tied_parameters(seq, balance, layout.stages)
        sharding.check_ties(seq, data_parallel, balance, layout.stages)
        # ties found before this stage's tensors replace the meta ones, which ends their sharing
        # with the other stages' (still meta) layers
        self.tied = tied.find_tied(seq, balance, layout.stages)
        self._plain_names = partition.plain_parameter_names(name, seq)  # a tie counted once, as on one device
        self._prefix = partition.key_prefix(name)
        start_stage(model, name, seq, balance, layout, rank, device, self.stage_only)
        stage = build(seq, balance)
        if isinstance(seq, PlanChain):  # the root holds the stage's layers and calls it as its forward
            self.installed = plan.install(seq, stage, PlanForward(seq, stage), deferred_batch_norm)
        else:
            self.installed = partition.install(model, name, stage, deferred_batch_norm=deferred_batch_norm)
        stage_compile = compiling.stage_compiler(compile, self._user_compile)
        if stage_compile is not None:
            stage.compile(stage_compile)
        self.stage, self.index, self.stages = stage, layout.stage_of(rank), layout.stages
        check_nothing_meta(model)
        self.balance = balance
        return stage

    def describe(self, model: nn.Module, spec: Any, layout: Layout, rank: int) -> None:
        """Log where the layers went and the balance a balancer chose (rank 0), and this rank's stage."""
        assert self.installed is not None and self.balance is not None and self.stage is not None
        seq, balance = self.installed.sequential, self.balance
        if rank == 0:
            rank_zero_info(
                partition.placement(seq, balance, [layout.rank(0, j) for j in range(layout.stages)])
            )
        if isinstance(spec, str) and rank == 0 and profiled(model):
            log_choice(model, spec, balance)  # type: ignore[arg-type]
        where = f"rank {rank} runs stage {self.index}/{layout.stages}"
        log.info(f"gpipe: {where} with layers {self.stage.layer_names}")

    def start_equal(self, layout: Layout, rank: int, groups: Any, module: Any, spec: StageSpec) -> None:
        """Every replica's stage takes replica 0's weights (``groups.data``: the stage's replicas' group), the
        tied copies their owner's, then the user's tensor-parallel plan runs on the stage
        (:func:`.tensor_parallel.parallelize`) and, with ``spec.data_parallel="fsdp"``, the stage is sharded
        over the mesh's data-parallel dimension (:func:`.sharding.shard_stage`), in torchtitan's order; the
        tied copies are then its shards (:func:`.tied.rebind_tied`). Every rank calls this.
        """
        assert self.stage is not None
        state.broadcast_from_first_replica(self.stage, layout, rank, groups.data)
        if distributed_is_initialized():
            self.tie(layout, rank)
        tensor_parallel.parallelize(module, self.running, groups.mesh, layout.tensors)
        self.sharded = sharding.shard_stage(self.stage, groups.mesh, spec.data_parallel, spec.schedule)
        if self.tied_groups is not None:  # the plan and FSDP's wrapping replace the module's parameters
            tied.rebind_tied(self.tied_groups, self.stage, self.index)

    def tie(self, layout: Layout, rank: int) -> None:
        """Process groups for the tied parameters (every rank calls this); the copies start equal."""
        if self.tied and self.stage is not None:
            self.tied_groups = tied.new_tied_groups(self.tied, self.stage, layout, rank)
            tied.broadcast_tied(self.tied_groups)

    def uninstall(
        self, layout: Layout, rank: int, arrive: Callable[[str], None], gather: bool = True
    ) -> None:
        """Put the user's full Sequential back, loaded with every stage's trained state when ``gather``.

        ``gather`` is a collective (every rank of the job calls it, after ``arrive(operation)``);
        a model built stage-only is put back as it is (each rank holds only its stage; a tensor-parallel
        stage's parameters whole again).
        """
        if self.installed is None or self.stage is None:
            return
        self.received_skips = list(self.stage.received_skips)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.sharded is not None and gather:  # whole plain parameters again (a collective)
            self.sharded.unshard()
        self.sharded = None
        full = None
        if gather and not self.stage_only:
            arrive("gathering the model's state (end of fit)")
            full = state.gather_sequential_state(self.stage, layout, rank, to_all=True, tied=self.tied)
        # the plain layers the gathered state loads into; stage-only: the stage's own, whole
        unparallelize(self.stage, whole=gather and self.stage_only)
        if isinstance(self.installed.sequential, PlanChain):
            plan.uninstall(self.installed, full)
        else:
            partition.uninstall(self.installed, full)
        compiling.recompile(self._uncompiled)
        self.installed, self.stage, self._uncompiled = None, None, []

    def refuse_batch_norm(self, chunks: int, mode: str) -> None:
        """Make the stage's BatchNorm layers refuse what ``batch_norm=mode`` refuses, named as in the
        user's module (:func:`.batch_norm.refusals`); undone at :meth:`uninstall`."""
        prefix = f"{self.name}." if self.name else ""
        self._hooks = batch_norm.refusals(self.running, prefix, chunks, mode)

    def refuse_uncalled(self, out: Any) -> None:
        """Raise if a training step returned a loss without calling the pipelined Sequential.

        Raises:
            PipelineUsageError: ``out`` is not ``None`` (the step would train wrongly).
        """
        if out is None:
            return
        if self.installed is not None and isinstance(self.installed.sequential, PlanChain):
            root = f"self.{self.installed.name}" if self.installed.name else "self"
            raise PipelineUsageError(
                f"training_step returned a loss without calling the model whose forward is the plan's chain "
                f"(stage {self.index}); under plan= call {root}(x) (or {root}.forward(x)), not its parts "
                "one by one: each process holds only its stage's parts"
            )
        raise PipelineUsageError(
            f"the pipelined module was not called in training_step, which returned a loss (stage "
            f"{self.index}): the step ran something other than the pipelined nn.Sequential "
            f"{self.name or '?'!r} (a wrapper or a reference to it kept from before fit) and would train "
            "wrongly; call the Sequential itself "
            "(it may be torch.compile-d: the strategy compiles each stage)"
        )

    @contextlib.contextmanager
    def configuring(self, device: torch.device) -> Iterator[None]:
        """Inside: ``configure_optimizers`` runs over the stage: an empty parameter if none is trainable
        (:func:`.partition.add_placeholder_parameter`; under a plan, the root's:
        :func:`lightning_gpipe.partition.plan.add_placeholder_parameter`), other stages' layers empty
        (``PipelineStage.__getitem__``)."""
        assert self.stage is not None and self.installed is not None
        if isinstance(self.installed.sequential, PlanChain):  # the stage is not in the model: its root is
            plan.add_placeholder_parameter(self.installed, device)
        else:
            partition.add_placeholder_parameter(self.stage, device)
        self.stage.configuring = True
        try:
            yield
        finally:
            self.stage.configuring = False

    @property
    def plain_names(self) -> list[str] | None:
        """The user's Sequential's parameter names, in model order, a tied parameter once (as a one-device
        optimizer holds it), while the stage is installed (:func:`.partition.plain_parameter_names`)."""
        return self._plain_names if self.installed is not None else None

    def tied_aliases(self) -> dict[str, str | None]:
        """This stage's names (in the model) of tied parameters: the owner's name, or ``None`` on the
        owner. Kept after ``fit`` (until the next cut): a model built stage-only keeps its stage then."""
        if not self.tied:
            return {}
        prefix = self._prefix
        aliases = tied.canonical_name(self.tied, self.index)
        return {prefix + k: None if v is None else prefix + v for k, v in aliases.items()}

    def owners(self) -> list[str]:
        """The model's names of the tied parameters this stage holds as copies (their owners' names)."""
        return [name for name in self.tied_aliases().values() if name is not None]

    def cut_copy(self, seq: nn.Sequential) -> nn.Module:
        """This stage's part of a copy of the pipelined Sequential (a callback's copy of the module)."""
        assert self.balance is not None
        copy = nn.Sequential()
        children(copy).update(partition.cut(seq, self.balance, self.index, self.stages))
        return copy

    def whole_model(self) -> contextlib.AbstractContextManager[None]:
        """The module holds its whole Sequential (every stage's layers; other stages' weights are not
        trained here) inside this context, the stage again after it. For summaries that count the model."""
        if self.installed is not None and isinstance(self.installed.sequential, PlanChain):
            return plan.whole(self.installed)
        return partition.whole_sequential(self.installed, self.stage)


def check_arguments(
    chunks: int | None,
    balance: list[int] | str | None,
    checkpoint: str,
    schedule: str,
    virtual_stages: int | None,
    pipeline_parallel_size: int | None,
    batch_norm: str = "batch",
) -> tuple[int | None, list[int] | str | None, str, str, int, str]:
    """``GPipeStrategy``'s arguments of the same names, checked: ``(chunks, balance, checkpoint, schedule,
    virtual_stages, batch_norm)``, ``virtual_stages`` chosen by ``schedule`` when ``None``; warns where
    ``schedule="zb_h1"`` would gain little.

    Raises:
        ValueError: a bad ``chunks``, ``checkpoint``, ``schedule``, ``virtual_stages``, ``balance`` or
            ``batch_norm`` (:func:`.batch_norm.check_batch_norm`).
    """
    chunks = check_count("chunks", chunks) if chunks is not None else None
    checkpoint, schedule = check_mode(checkpoint), check_schedule(schedule)
    v = check_virtual_stages(schedule, virtual_stages)
    microstep.warn_unsplit_backwards(schedule, checkpoint)
    balance = check_balance_spec(balance, pipeline_parallel_size, v)
    return chunks, balance, checkpoint, schedule, v, check_batch_norm(batch_norm)


def partition_model(
    pipelined: Pipelined,
    model: pl.LightningModule,
    spec: StageSpec,
    layout: Layout,
    rank: int,
    device: torch.device,
    lanes: Lanes | None,
    broadcast: Callable[[Any], Any],
    to_device: Callable[[Any], Any],
) -> Timeline | None:
    """Cut the user's Sequential as ``spec`` says and put this rank's stage in its place (:meth:`.install`).

    Args:
        lanes: the transport's lanes (:attr:`.Groups.lanes`), ``None`` without process groups.
        broadcast, to_device: the strategy's ``broadcast`` and ``batch_to_device``, for a balancer
            that measures the model (:func:`~lightning_gpipe.strategy.balance_spec.choose_balance`).

    Returns:
        The stage's :class:`~lightning_gpipe.tools.timeline.Timeline` with ``spec.timeline``, else ``None``.
    """
    choose = functools.partial(
        choose_balance, spec.balance, model, stages=layout.stages * spec.virtual_stages, chunks=spec.chunks,
        device=device, rank=rank, broadcast=broadcast, to_device=to_device,
        optimizer_state_factor=spec.optimizer_state_factor,
    )  # fmt: skip
    schedule = SCHEDULES[spec.schedule]

    def build(seq: nn.Sequential, balance: list[int]) -> PipelineStage:
        return build_stage(seq, balance, layout, rank, spec.chunks, spec.checkpoint, device, schedule, lanes)

    checked = pipelined.check_model(model, spec, layout.stages)
    norms = batch_norm.batch_norms(checked[1])
    stage = pipelined.install(
        model, checked, spec.balance, layout, rank, device, choose, build,
        deferred_batch_norm=spec.deferred_batch_norm, compile=spec.compile, data_parallel=spec.data_parallel,
    )  # fmt: skip
    if spec.batch_norm == "micro_batch":  # GPipe's per-micro-batch statistics, never of one sample
        batch_norm.keep_two_samples(stage, norms)
    # "batch": a training BatchNorm under M > 1 raises at its first forward; so does a training
    # SyncBatchNorm synchronizing over every rank, in either mode
    pipelined.refuse_batch_norm(spec.chunks, spec.batch_norm)
    timeline = None
    if spec.timeline:
        timeline = stage.timeline = Timeline(
            layout.stage_of(rank), layout.stages, rank, layout.replica_of(rank),
            virtual_stages=spec.virtual_stages, schedule=spec.schedule,
        )  # fmt: skip
    pipelined.describe(model, spec.balance, layout, rank)
    return timeline
