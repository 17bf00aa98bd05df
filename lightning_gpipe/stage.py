"""One pipeline stage: the module that replaces the user's ``nn.Sequential`` on each rank.

:class:`PipelineStage` holds only this rank's layers, under their original names (so its
``state_dict`` keys are the user's), and executes this stage's column of a schedule
(:mod:`lightning_gpipe.schedule`, :func:`~lightning_gpipe.schedule.fill_drain` by default) in
order, as a cursor: it runs its actions while they are runnable and stops where an action waits
for something only the user's code provides. ``F i`` runs inside the user's call of the
Sequential that gives micro-batch ``i`` (on the first stage, its input; on the last stage, the
call returns its output); ``B i`` needs micro-batch ``i``'s loss. Receives only block on peers.
Two contracts drive the cursor:

- one call per step (``schedule="gpipe"``): the call covers every micro-batch and the step's
  loss exists once the user's step has returned, so the column runs in two phases
  (:func:`~lightning_gpipe.schedule.split_phases`): the forward phase inside the user's step,
  the backward phase when Lightning calls ``backward``;
- one call per micro-batch (:meth:`PipelineStage.start_micro_steps`, the other schedules,
  :mod:`lightning_gpipe.microstep`): call ``i`` gives micro-batch ``i``; on the last stage
  ``B i`` runs once the strategy has backpropagated micro-batch ``i``'s loss into its output
  (:meth:`PipelineStage.loss_backpropagated`); the other stages' backwards wait only for their
  gradients, so a 1F1B column interleaves forwards and backwards inside the calls.

In order, within a step:

- the forward of a call: the first stage splits the mini-batch into micro-batches (one call
  per step) or takes the call's micro-batch, the others learn M from the first message's
  header; then each runnable action runs. ``F i``: receive micro-batch ``i`` (and its skips),
  compute it (recomputable under ``torch.utils.checkpoint``), send it on. The last stage returns
  the call's output, its micro-batches concatenated, as leaves detached from the pipeline's
  graph so that the user's loss backpropagates only to them; the other stages raise
  :class:`StageDone` to leave the user's step.
- ``B i``: receive the output's gradient (on the last stage: split the leaves' gradients),
  backpropagate, send the input's gradient.
- the step outcome (after the user's step, :meth:`PipelineStage.share_outcome`,
  :mod:`lightning_gpipe.outcome`): the last stage tells the others whether the step has a loss,
  so that Lightning calls ``backward`` on every stage or on none, with
  ``trainer.callback_metrics`` and ``should_stop``. One call per step: it comes between the
  forward and the backward phase; one call per micro-batch: after every action.

Every receive and send is one that :func:`~lightning_gpipe.schedule.receives` and
:func:`~lightning_gpipe.schedule.sends` name for the action. Before running a stretch of its
column the stage announces to the transport the messages that stretch will receive, counted
from its actions (:func:`~lightning_gpipe.schedule.messages`): every action up to the first
backward whose forward has not run yet (whether its gradient flows is known only then), never
past the step's loss under one call per step (the outcome message comes first). Which
micro-batches recompute their forward is :mod:`lightning_gpipe.recompute`'s rule; the recompute
runs on the module state its forward saw and changes nothing (:mod:`lightning_gpipe.effects`).

Virtual stages (``schedule="interleaved_1f1b"``, :func:`~lightning_gpipe.schedule.interleaved_1f1b`):
the stage holds parts ``j, j+K, …`` of the Sequential (:attr:`PipelineStage.virtual_layers`), an
action runs its virtual stage's layers, and what the forward keeps is kept per (micro-batch,
virtual stage). The part that takes the user's input (stage 0's virtual stage 0) and the part whose
output a call returns (the last stage's last virtual stage) wait for their call; the last stage's
other forwards run ahead of the calls. Where the grid's stages take a peer's messages in another
order than the peer's column sends them (:func:`~lightning_gpipe.schedule.in_send_order`), each
send waits until the messages the peer takes before it have gone, so a peer's messages always
arrive in the order they are taken.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe import recompute, schedule
from lightning_gpipe._compat import children
from lightning_gpipe.batchnorm import no_accumulate
from lightning_gpipe.comm import P2P, Meta
from lightning_gpipe.effects import ForwardState
from lightning_gpipe.failure import naming_errors
from lightning_gpipe.layout import Layout, StageTopology, layer_parts
from lightning_gpipe.microbatch import Structure, flatten, gather, scatter, unflatten
from lightning_gpipe.outcome import OutcomeChannel, apply_outcome, outcome_of
from lightning_gpipe.partition import virtual_cut
from lightning_gpipe.schedule import Action, Grid
from lightning_gpipe.skip import MicroBatchStore, routes, use_store


class StageDone(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Leaves the user's step on a non-last stage once its forward is done.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it; the strategy
    catches it around the step.
    """


class PipelineUsageError(RuntimeError):
    """The pipelined module was used in a way the pipeline cannot run (e.g. called twice in a step)."""


@dataclass
class _Call:
    """Last stage: one call of the step, for splitting its leaves' gradients per micro-batch."""

    covered: list[int]  # the micro-batches it covered
    sizes: list[list[int]]  # per leaf, its parts' dim-0 sizes
    leaves: tuple[Tensor, ...]  # the detached outputs given to the user
    whole: tuple[bool, ...]  # per leaf: replicated (micro-batch 0's), not joined


@dataclass
class _Run:
    """One step's execution state: where the cursor stands, the micro-batches and what the forward keeps."""

    train: bool
    chunks: int
    column: list[Action]  # this stage's actions (only the forwards when not training)
    whole: bool  # one call covers every micro-batch (schedule="gpipe"); else one call per micro-batch
    micro_batches: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)  # first stage: given inputs
    in_structures: dict[int, Structure] = field(default_factory=dict)  # first stage: how they make values
    first: tuple[Meta, list[Tensor]] | None = None  # other stages: micro-batch 0's message, taken early
    taken: Counter[int] = field(default_factory=Counter)  # messages taken before any announcement
    # keyed by (micro-batch, virtual stage)
    out_structures: dict[tuple[int, int], Structure] = field(default_factory=dict)  # how outputs make values
    inputs: dict[tuple[int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    skips_in: dict[tuple[int, int], dict[str, Tensor]] = field(default_factory=dict)  # received skips
    skips_out: dict[tuple[int, int], dict[str, Tensor]] = field(default_factory=dict)  # skips sent on
    called: int = 0  # micro-batches 0 .. called-1 have had their call
    forwarded: set[tuple[int, int]] = field(
        default_factory=set
    )  # (micro-batch, virtual stage) forwarded here
    losses: set[int] = field(default_factory=set)  # one call per micro-batch: losses backpropagated
    step_loss: bool = False  # one call per step: Lightning's backward has come
    pos: int = 0  # the cursor: index of the next action in column
    announced: int = 0  # receives of column[:announced] are announced
    fill_end: int = 0  # index after the column's last forward
    states: list[ForwardState] = field(default_factory=list)  # recomputed micro-batches' module states
    # last stage, per call: the micro-batches it covered, each leaf's part sizes, the leaves given to
    # the user and which of them are replicated (micro-batch 0's)
    calls: list[_Call] = field(default_factory=list)
    leaf_grads: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    # a grid whose stages take a peer's messages in another order than it sends them
    # (schedule.in_send_order false): per peer stage, the keys (kind, i, virtual stage here, skip)
    # in the order the peer takes them; sends wait in outbox until their turn
    order: dict[int, list[tuple[str, int, int, str | None]]] = field(default_factory=dict)
    outbox: dict[int, dict[tuple[str, int, int, str | None], Any]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.pos == len(self.column)


class PipelineStage(nn.Sequential):
    """This rank's partition of the pipelined ``nn.Sequential``, executing its schedule column.

    Args:
        layers: ``(name, layer)`` pairs of this stage, names as in the user's Sequential.
        topology: stage index, stage count and neighbour ranks.
        chunks: number of micro-batches M (≥ 1).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        p2p: the transport.
        names: layer names of the user's whole Sequential (for indexing by its indices).
        schedule: ``(stages, chunks) -> Grid`` (default: :func:`~lightning_gpipe.schedule.fill_drain`).
        virtual_layers: with virtual stages, the names of each virtual stage's layers, in order
            (stage ``j``'s virtual stage ``u`` holds part ``j + u·K``:
            :func:`~lightning_gpipe.partition.virtual_cut`); default: one virtual stage holding
            every layer. The stage holds all of them under the user's names either way.

    Shapes: the first stage takes ``(N, *)`` (or a tuple, or any pytree:
    :mod:`lightning_gpipe.microbatch`) and splits it into ``min(M, N) × (≈N/M, *)``; the last stage
    returns ``(N, *)`` outputs (replicated leaves as they are).
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        topology: StageTopology,
        chunks: int,
        checkpoint: str,
        p2p: P2P,
        names: Sequence[str] | None = None,
        schedule: Callable[[int, int], Grid] = schedule.fill_drain,
        virtual_layers: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().__init__(OrderedDict(layers))
        self.names = list(names) if names is not None else [n for n, _ in layers]  # of the whole Sequential
        held = [n for n, _ in layers]
        self.virtual_layers = [list(v) for v in virtual_layers] if virtual_layers is not None else [held]
        if sorted(n for v in self.virtual_layers for n in v) != sorted(held):
            raise ValueError(
                f"the virtual stages' layers ({self.virtual_layers}) are not the stage's layers ({held})"
            )
        self.topology = topology
        self.chunks = chunks
        self.checkpoint_mode = checkpoint
        self.p2p = p2p
        self.expect_backward = False  # set by the strategy around training_step
        self.active = False  # set by the strategy around every step
        self.schedule = schedule
        self.calls = 0
        self.configuring = False  # set by the strategy around configure_optimizers
        self.outcomes = OutcomeChannel(p2p, p2p.device)
        self._run: _Run | None = None  # the step in progress
        self._micro: int | None = None  # one call per micro-batch: their number in this step
        self.timeline: Any = (
            None  # a lightning_gpipe.timeline.Timeline (anything with span(kind, i, u)), or None
        )
        self.received_skips: list[tuple[str, int]] = []  # (name, source stage), for inspection and tests
        self.__dict__["_compiled"] = (
            None  # per virtual stage, its layers compiled (not a submodule: state_dict keys unchanged)
        )

    def compile(self, compile_fn: Any) -> None:  # type: ignore[override]
        """Run each virtual stage's layers through ``compile_fn(nn.Sequential of the layers)`` (e.g. ``torch.compile``).

        The compiled module shares the layers (parameters, buffers); it is kept outside the
        stage's submodules, so ``state_dict`` keys stay the user's.
        """
        self.__dict__["_compiled"] = [
            compile_fn(nn.Sequential(OrderedDict((n, self._modules[n]) for n in names)))
            for names in self.virtual_layers
        ]

    def __iter__(self) -> Iterator[nn.Module]:
        """The stage's layers; inside a step, iterating raises: the pipeline runs one call per step.

        Raises:
            PipelineUsageError: iterated inside a step (``for layer in self.layers: ...``), where
                this process holds only its stage's layers.
        """
        if self.active:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was iterated inside a step (for layer in ...); under the gpipe "
                f"strategy this process holds only stage {self.topology.stage}'s layers ({', '.join(self._modules)}) "
                "and the pipeline runs one forward per step: call the Sequential once (self.layers(x))"
            )
        return iter(self._modules.values())

    @property
    def virtual_stages(self) -> int:
        """v: the virtual stages this stage holds (1 without)."""
        return len(self.virtual_layers)

    @property
    def layer_names(self) -> list[str]:
        """Names of this stage's layers, as in the user's Sequential."""
        return list(self._modules)

    def __getitem__(self, idx: Any) -> Any:
        """``layers[k]`` with ``k`` the layer's index in the user's whole Sequential.

        While the optimizers are configured (``configure_optimizers``), a layer on another stage is
        an empty module and a slice an ``nn.Sequential`` of this stage's layers within it, so that
        one-device code such as ``{"params": self.layers[-1].parameters(), "lr": ...}`` builds the
        same groups, empty where the stage holds none of their layers.

        Raises:
            PipelineUsageError: otherwise, layer ``k`` lives on another stage, or ``idx`` is a slice.
        """
        if isinstance(idx, slice):
            if self.configuring:
                wanted = self.names[idx]
                return nn.Sequential(OrderedDict((n, m) for n, m in self._modules.items() if n in wanted))
            raise PipelineUsageError(
                "slicing the pipelined nn.Sequential is not supported under the gpipe strategy outside "
                f"configure_optimizers: each process holds only its stage's layers ({', '.join(self._modules)})"
            )
        index = int(idx) + len(self.names) if int(idx) < 0 else int(idx)
        if 0 <= index < len(self.names) and self.names[index] in self._modules:
            return self._modules[self.names[index]]
        if self.configuring and 0 <= index < len(self.names):
            return nn.Module()  # held by another stage: no parameters here
        raise PipelineUsageError(
            f"layer {idx} of the pipelined nn.Sequential lives on another stage: this process runs stage "
            f"{self.topology.stage}, which holds layers {', '.join(self._modules)}; access a layer only "
            "where it lives, or outside fit (the Sequential is whole again afterwards)"
        )

    def _span(self, kind: str, i: int, u: int = 0) -> Any:
        """Record ``kind`` (forward, recompute, backward, send, recv) of micro-batch ``i`` on virtual
        stage ``u`` on the timeline."""
        return self.timeline.span(kind, i, u) if self.timeline is not None else nullcontext()

    # -- the forward phase ------------------------------------------------------------------

    def begin_step(self, expect_backward: bool) -> None:
        """Called by the strategy before a user step; ``expect_backward`` for training steps."""
        self.active = True
        self.calls = 0
        self.expect_backward = expect_backward
        if self._micro is None:  # a step's calls start its run afresh
            self._run = None

    def end_step(self) -> None:
        self.active = False

    def run_step(self, step: Callable[..., Any], expect_backward: bool, *args: Any, **kwargs: Any) -> Any:
        """``step(*args, **kwargs)`` (a user step calling this stage) between :meth:`begin_step` and
        :meth:`end_step`; :class:`StageDone` itself is returned where a non-last stage left the step."""
        self.begin_step(expect_backward)
        try:
            return step(*args, **kwargs)
        except StageDone:
            return StageDone
        finally:
            self.end_step()

    @property
    def ran_forward(self) -> bool:
        return self.calls > 0

    def local_forward(self, input: Any, store: MicroBatchStore | None = None, virtual_stage: int = 0) -> Any:
        """Virtual stage ``virtual_stage``'s layers (all of this stage's without virtual stages) applied
        in order, as ``nn.Sequential`` would, with ``store`` for skips."""
        compiled = self.__dict__["_compiled"]
        with use_store(store if store is not None else MicroBatchStore()):
            if compiled is not None:
                return compiled[virtual_stage](input)
            for name in self.virtual_layers[virtual_stage]:
                input = self._modules[name](input)
        return input

    def forward(self, input: Any) -> Any:  # noqa: A002 - nn.Sequential's own argument name
        if not self.active:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called outside training/validation/test/predict_step; "
                "under the gpipe strategy it runs only inside the LightningModule's step methods"
            )
        if self.calls:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called twice in one step; the gpipe strategy runs one "
                "forward per step (concatenate the inputs and call it once)"
            )
        self.calls += 1
        top = self.topology
        train = self.expect_backward and torch.is_grad_enabled()
        run = self._run if self._micro is not None else None
        if run is None:
            run = self._run = self._start(input, train)
        elif top.is_first:
            (run.micro_batches[run.called],), run.in_structures[run.called] = scatter(input, 1)
        if run.called == run.chunks:
            raise PipelineUsageError(
                f"the pipelined nn.Sequential was called for more micro-batches than the step has ({run.chunks})"
            )
        covered = list(range(run.called, run.chunks if run.whole else run.called + 1))
        run.called = covered[-1] + 1
        self._advance(run)
        if not top.is_last:
            raise StageDone
        last = self.virtual_stages - 1
        outputs = [run.outputs[(i, last)] for i in covered]
        structures = [run.out_structures[(i, last)] for i in covered]
        joined, structure = gather(outputs, structures, f"output of the last pipeline stage ({top.stage})")
        if train:
            joined = tuple(t.detach().requires_grad_(t.requires_grad) for t in joined)
            sizes = [[o[k].shape[0] if o[k].dim() else 1 for o in outputs] for k in range(len(joined))]
            run.calls.append(_Call(covered, sizes, joined, structure.whole))
        return unflatten(structure, joined)

    def _start(self, input: Any, train: bool) -> _Run:
        """A new run at the step's first call: M from the split (first stage) or the first message."""
        top = self.topology
        if top.is_first:
            parts, structure = scatter(input, self.chunks if self._micro is None else 1)
            run = self._new_run(train, len(parts) if self._micro is None else self._micro)
            run.micro_batches = dict(enumerate(parts))
            run.in_structures = dict.fromkeys(range(len(parts)), structure)
            return run
        with self._span("recv", 0):  # M comes with the first message
            first = self.p2p.recv(self._rank(top.stage - 1))
        if self._micro is not None and first[0].chunks != self._micro:
            raise RuntimeError(
                f"stage {top.stage} runs {self._micro} micro-batches but stage {top.stage - 1} sent "
                f"{first[0].chunks}; the stages split different batches"
            )
        run = self._new_run(train, first[0].chunks)
        run.first, run.taken = first, Counter({top.stage - 1: 1})
        return run

    def _new_run(self, train: bool, chunks: int) -> _Run:
        top = self.topology
        v = self.virtual_stages
        grid = self.schedule(top.stages, chunks) if v == 1 else self.schedule(top.stages, chunks, v)  # type: ignore[call-arg]
        column = schedule.stage_actions(grid, top.stage)
        if not train:
            column = [a for a in column if a.kind == "F"]
        whole = self._micro is None
        fill_end = 1 + max(k for k, a in enumerate(column) if a.kind == "F")
        if whole and train and top.is_last and any(a.kind == "B" for a in column[:fill_end]):
            raise PipelineUsageError(
                f"this schedule runs a backward on the last stage before its last forward ({column}); it "
                "needs the user's training_step once per micro-batch (GPipeStrategy(schedule=...) does that)"
            )
        run = _Run(train, chunks, column, whole, fill_end=fill_end)
        if train and v > 1 and not schedule.in_send_order(grid, top.skips):
            for peer in range(top.stages):
                taken: list[tuple[str, int, int, str | None]] = [
                    (a.kind, a.i, t.virtual_stage, t.skip)
                    for a in schedule.stage_actions(grid, peer)
                    for t in schedule.receives(a, peer, top.stages, top.skips, v)
                    if t.peer == top.stage
                ]
                if taken:
                    run.order[peer], run.outbox[peer] = taken, {}
        return run

    def _ready(self, action: Action, run: _Run) -> bool:
        """Whether ``action`` can run now: what it needs from the user's code has come."""
        top, v = self.topology, self.virtual_stages
        if action.kind == "F":
            # a call gives micro-batch i: its input (virtual stage 0) or, on the last stage, its output
            # (the last virtual stage); the last stage's other forwards run ahead of the calls
            gated = action.virtual_stage == (v - 1 if top.is_last else 0)
            return action.i < run.called or not gated
        if run.whole:
            return run.step_loss
        return action.i in run.losses or not schedule.needs_loss(action, top.stage, top.stages, v)

    def _advance(self, run: _Run) -> None:
        """Run ``run``'s column from the cursor while its actions are runnable."""
        while not run.done and self._ready(run.column[run.pos], run):
            if run.pos >= run.announced:
                self._announce_from(run)
            self._execute(run.column[run.pos], run)
            run.pos += 1
            if run.pos == run.fill_end:  # no forward follows: what the fill left unchanged needs no copy
                for state in run.states:
                    state.prune()
                run.states = []
            if not run.whole:
                self.p2p.settle()  # a 1F1B stage frees what it sent as it goes
        if run.done:
            self._run = None
        if run.done or run.whole:
            self.p2p.flush()

    def _announce_from(self, run: _Run) -> None:
        """Announce the receives of the column from the cursor up to the first backward whose
        forward has not run (or, with one call per step, that waits for the step's loss)."""
        top, end = self.topology, run.pos
        while end < len(run.column):
            a = run.column[end]
            if a.kind == "B" and (
                (a.i, a.virtual_stage) not in run.forwarded or (run.whole and not run.step_loss)
            ):
                break
            end += 1
        stretch = run.column[run.pos : end]
        self._announce(
            schedule.messages(
                stretch, top.stage, top.stages, top.skips, partial(_flows, run), self.virtual_stages
            )
            - run.taken
        )
        run.taken, run.announced = Counter(), end

    def _execute(self, action: Action, run: _Run) -> None:
        """Run one action of this stage's column: ``F i`` or ``B i``."""
        if action.kind == "F":
            self._forward_one(action, run)
        else:
            self._backward_one(action, run)

    def _forward_one(self, action: Action, run: _Run) -> None:
        """``F i``: receive micro-batch ``i`` and its skips, compute it, send it and its skips on."""
        top, i, u, v = self.topology, action.i, action.virtual_stage, self.virtual_stages
        key = (i, u)
        first_part = top.is_first and u == 0
        last_part = top.is_last and u == v - 1
        x = run.micro_batches.pop(i) if first_part else ()
        x_structure = run.in_structures.pop(i) if first_part else None
        run.forwarded.add(key)
        store = MicroBatchStore()
        received = schedule.receives(action, top.stage, top.stages, top.skips, v)
        for t in received:
            meta, tensors = self._receive(t, i, u, run)
            if t.skip is None:
                x, x_structure = _as_inputs(meta, tensors, run.train), meta.structure
            else:
                store[t.skip] = _as_inputs(meta, tensors, run.train)[0]
                self.received_skips.append((t.skip, t.peer))
        assert x_structure is not None  # the first stage's split, or the message's
        with self._span("forward", i, u), self._naming_errors("forward", i, x):
            y = self._compute(i, u, run, unflatten(x_structure, x), store)
        kept = [t for t, whole in zip(x, x_structure.whole) if whole]  # replicated, stay so passed on
        y_tensors, y_structure = flatten(y, f"output of pipeline stage {top.stage}", kept)
        sent = schedule.sends(action, top.stage, top.stages, top.skips, v)
        if run.train:
            run.inputs[key] = x
            run.skips_in[key] = {t.skip: store[t.skip] for t in received if t.skip is not None}
            run.skips_out[key] = {t.skip: store[t.skip] for t in sent if t.skip is not None}
        if run.train or last_part:
            run.outputs[key] = y_tensors
            run.out_structures[key] = y_structure
        for t in sent:  # the output first, then the skips: the order in which they are received
            payload = y_tensors if t.skip is None else (store[t.skip],)
            self._post(run, action, t, payload, structure=y_structure if t.skip is None else None)

    def _receive(self, t: schedule.Transfer, i: int, u: int, run: _Run) -> tuple[Meta, list[Tensor]]:
        if t.skip is None and run.first is not None:
            first, run.first = run.first, None
            return first
        with self._span("recv", i, u):
            return self.p2p.recv(self._rank(t.peer))

    def _rank(self, stage: int) -> int:
        """The global rank of stage ``stage`` of this pipeline."""
        top = self.topology
        neighbour = (
            top.prev_rank if stage == top.stage - 1 else top.next_rank if stage == top.stage + 1 else None
        )
        return neighbour if neighbour is not None else top.ranks[stage]

    def _announce(self, messages: Counter[int]) -> None:
        """Tell the transport how many messages this phase still receives from each stage."""
        for stage, n in messages.items():
            self.p2p.expect(self._rank(stage), n)

    def _compute(self, i: int, u: int, run: _Run, x: Any, store: MicroBatchStore) -> Any:
        """Virtual stage ``u``'s layers on micro-batch ``i``, recomputable under ``checkpoint``."""
        if not (run.train and recompute.recomputes(self.checkpoint_mode, i, run.chunks)):
            return self.local_forward(x, store, u)
        # what this forward changes, it changes once (the recompute replays it); the layers, not the
        # stage: iterating the stage inside a step is refused
        layers = self._virtual_modules(u)
        state = ForwardState.capture(layers)
        run.states.append(state)
        return recompute.run(
            partial(self.local_forward, virtual_stage=u),
            x,
            store,
            context=lambda: self._recompute_context(i, u, state, layers),
        )

    def _virtual_modules(self, u: int) -> list[nn.Module]:
        """Virtual stage ``u``'s layers (all of the stage's without virtual stages)."""
        return [self._modules[name] for name in self.virtual_layers[u]]  # type: ignore[misc]

    def _post(self, run: _Run, action: Action, t: schedule.Transfer, payload: Any, **options: Any) -> None:
        """Send what ``action`` sends over ``t`` (``payload`` ``None``: nothing flows), in the order the
        peer takes its messages: where a grid's stages take them in another order than sent
        (:func:`~lightning_gpipe.schedule.send_order`), a message waits here for its turn."""
        order = run.order.get(t.peer)
        if order is None:
            if payload is not None:
                with self._span("send", action.i, action.virtual_stage):
                    self.p2p.send(payload, self._rank(t.peer), chunks=run.chunks, **options)
            return
        box = run.outbox[t.peer]
        box[(action.kind, action.i, action.virtual_stage, t.skip)] = (payload, options)
        while order and order[0] in box:
            (_, ready_i, ready_u, _), (ready, ready_options) = order[0], box.pop(order.pop(0))
            if ready is not None:
                with self._span("send", ready_i, ready_u):
                    self.p2p.send(ready, self._rank(t.peer), chunks=run.chunks, **ready_options)

    def _naming_errors(self, phase: str, i: int, x: Sequence[Tensor]) -> Any:
        """Errors of this stage's layers re-raised as a :class:`~lightning_gpipe.failure.StageError`."""
        first = next(iter(self._modules.values()), None)  # iter(self) refuses inside a step
        top = self.topology
        return naming_errors(top.stage, self.layer_names, first, phase, i, x, keep=(PipelineUsageError,))

    @contextmanager
    def _recompute_context(
        self, i: int, u: int, state: ForwardState, layers: Sequence[nn.Module]
    ) -> Iterator[None]:
        with self._span("recompute", i, u), state.replay(layers), no_accumulate():
            yield

    # -- the step outcome --------------------------------------------------------------------

    def share_outcome(self, out: Any, trainer: Any, training: bool) -> Any:
        """The last stage sends its step outcome to the other stages, which install it (:mod:`lightning_gpipe.outcome`).

        Call after a step whose forward ran, before Lightning runs any hook. On the last stage
        ``out`` is the user's step output and is returned; it sends whether the step has a loss
        (and its value), ``trainer.should_stop`` and ``trainer.callback_metrics`` to every other
        stage of its pipeline. After a training step the others return the loss value as a scalar
        that requires grad (so that Lightning calls ``backward`` on every stage), or ``None`` when
        the step has no loss (a ``training_step`` returning ``None``; Lightning itself refuses that
        when several processes run), and then drop what the forward kept.
        """
        top = self.topology
        if top.stages == 1:
            return out
        self.outcomes.p2p = self.p2p  # the stage's transport, whichever it holds now
        if top.is_last:
            outcome = outcome_of(trainer, out if training else None)
            for rank in top.ranks[:-1]:
                self.outcomes.send(outcome, rank)
            if not (training and outcome.has_loss):
                self.p2p.flush()
                self.backward_skipped()
            # else the backward's own flush waits for these sends: the drain starts now
            return out
        outcome = self.outcomes.receive(top.ranks[-1])
        apply_outcome(trainer, outcome)
        if not training:
            return out
        if not outcome.has_loss:
            self.backward_skipped()
            return None
        return torch.tensor(outcome.loss, device=self.p2p.device, requires_grad=True)

    # -- the backward phase -----------------------------------------------------------------

    def backward_skipped(self) -> None:
        """The step has no loss (the user's step returned ``None``): drop what the forward kept."""
        self._run = None

    def backward(self) -> None:
        """Lightning's ``backward``: with one call per step, run this stage's backward phase (in
        reverse micro-batch order under fill-drain); a no-op where no forward needs one (one call per
        micro-batch: the backwards ran with the calls). Waits for every send posted."""
        run = self._run if self._micro is None else None
        if run is None:
            self.p2p.flush()
            return
        run.step_loss = True
        self._advance(run)

    # -- one call per micro-batch (lightning_gpipe.microstep) --------------------------------

    def start_micro_steps(self, chunks: int) -> None:
        """The next ``chunks`` training calls are one step's micro-batches ``0 .. chunks-1``, one each.

        Between them the strategy backpropagates each micro-batch's loss (last stage) and calls
        :meth:`loss_backpropagated`; :meth:`end_micro_steps` closes the step.
        """
        self._micro, self._run = chunks, None

    def loss_backpropagated(self, i: int) -> None:
        """Last stage: micro-batch ``i``'s loss has reached its output leaves; run ``B i`` and what follows."""
        run = self._run
        if run is None or i in run.losses or i >= run.called:
            raise RuntimeError(f"micro-batch {i} has no forward waiting for its loss on this stage")
        run.losses.add(i)
        self._advance(run)

    def end_micro_steps(self) -> None:
        """Close a step run with :meth:`start_micro_steps`: its column must have run to the end.

        Raises:
            PipelineUsageError: the column stopped early (a call of the step did not call the
                Sequential, or a loss never came back), naming the action it waits at.
        """
        run, self._run, self._micro = self._run, None, None
        if run is not None and not run.done:
            waiting = run.column[run.pos]
            raise PipelineUsageError(
                f"stage {self.topology.stage} stopped at {waiting} of its column with {run.called} of "
                f"{run.chunks} micro-batches called; every training_step call must call the pipelined "
                "nn.Sequential once and return a loss"
            )

    def _backward_one(self, action: Action, run: _Run) -> None:
        """``B i``: receive the gradients of micro-batch ``i``'s outputs, backpropagate, send its inputs' gradients."""
        top, i, u, v = self.topology, action.i, action.virtual_stage, self.virtual_stages
        key = (i, u)
        y_grad = [t for t in run.outputs[key] if t.requires_grad]
        dy = list(self._leaf_grads(run, i)) if schedule.needs_loss(action, top.stage, top.stages, v) else []
        for t in schedule.receives(action, top.stage, top.stages, top.skips, v):
            if not _flows(run, action, t):
                continue
            with self._span("recv", i, u):
                _, grads = self.p2p.recv(self._rank(t.peer))
            if t.skip is None:
                dy = grads
            else:  # the gradient of a skip this stage sent on comes straight back
                y_grad, dy = [*y_grad, run.skips_out[key][t.skip]], [*dy, *grads]
        if y_grad:
            with self._span("backward", i, u), self._naming_errors("backward", i, run.inputs[key]):
                torch.autograd.backward(y_grad, dy)
        for t in schedule.sends(action, top.stage, top.stages, top.skips, v):
            sources = run.inputs[key] if t.skip is None else (run.skips_in[key][t.skip],)
            x_grad = [x for x in sources if x.requires_grad]
            dx = [x.grad if x.grad is not None else torch.zeros_like(x) for x in x_grad]
            self._post(run, action, t, dx or None)
        run.inputs[key] = run.outputs[key] = ()  # free this micro-batch
        run.skips_in[key] = run.skips_out[key] = {}

    def _leaf_grads(self, run: _Run, i: int) -> tuple[Tensor, ...]:
        """Last stage: the gradients the user's loss left on micro-batch ``i``'s part of its call's
        leaves: a joined leaf's split as it was joined, a replicated leaf's to the call's first
        micro-batch (zeros to the others)."""
        if i not in run.leaf_grads:
            call = next(c for c in run.calls if i in c.covered)
            run.calls.remove(call)  # the leaves are not needed again: their gradients are split here
            per: dict[int, list[Tensor]] = {k: [] for k in call.covered}
            for leaf, sizes, whole in zip(call.leaves, call.sizes, call.whole):
                if not leaf.requires_grad:
                    continue
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                parts = (
                    (grad, *(torch.zeros_like(grad) for _ in call.covered[1:]))
                    if whole
                    else grad.split(sizes)
                )
                for k, part in zip(call.covered, parts):
                    per[k].append(part)
            run.leaf_grads.update({k: tuple(v) for k, v in per.items()})
        return run.leaf_grads.pop(i)


def build_stage(
    seq: nn.Sequential,
    balance: Sequence[int],
    layout: Layout,
    rank: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    schedule: Callable[[int, int], Grid] = schedule.fill_drain,
) -> PipelineStage:
    """Global rank ``rank``'s :class:`PipelineStage` of ``seq`` cut by ``balance`` (layers shared, not
    copied), running ``schedule`` (a function of :data:`lightning_gpipe.schedule.SCHEDULES`).

    With virtual stages, ``balance`` has ``K·v`` entries (one per part) and the stage holds
    parts ``j, j+K, …`` as its virtual stages (:func:`~lightning_gpipe.partition.virtual_cut`);
    skip routes name parts.
    """
    topology = layout.topology(rank, tuple(routes(seq, layer_parts(balance))))
    per_virtual = virtual_cut(seq, balance, topology.stage, layout.stages)
    layers = [pair for part in per_virtual for pair in part]
    names = list(children(seq))
    virtual_layers = [[n for n, _ in part] for part in per_virtual]
    return PipelineStage(layers, topology, chunks, checkpoint, P2P(device), names, schedule, virtual_layers)


def _flows(run: _Run, action: Action, t: schedule.Transfer) -> bool:
    """Whether ``t``, received by ``action``, carries a message in this run: a backward receives a
    gradient only for tensors it sent that require one."""
    if action.kind == "F":
        return True
    key = (action.i, action.virtual_stage)
    if t.skip is None:
        return any(y.requires_grad for y in run.outputs[key])
    return run.skips_out[key][t.skip].requires_grad


def _as_inputs(meta: Meta, received: list[Tensor], train: bool) -> tuple[Tensor, ...]:
    """Received activations: floating tensors the sender tracks gradients for get ``requires_grad``."""
    return tuple(
        t.requires_grad_(train and rg and t.is_floating_point())
        for t, (_, _, rg) in zip(received, meta.specs)
    )
