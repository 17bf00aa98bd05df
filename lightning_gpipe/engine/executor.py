"""The executor of one stage's schedule column: runs ``F i`` and ``B i`` in order, receiving,
computing and sending exactly what each action names.

:class:`ColumnExecutor` is the component of :class:`~lightning_gpipe.engine.stage.PipelineStage`
that runs actions over a :class:`~lightning_gpipe.engine.plan.StepRun`: it builds the step's run
from the schedule's grid (M from the first stage's split or the first message's header; what each
action receives and sends is planned once per step shape,
:class:`~lightning_gpipe.engine.plan.ColumnPlan`), runs the column from its cursor while the actions
are runnable, receives what each action names as it runs it, computes each micro-batch on the
stage's own random stream (:mod:`lightning_gpipe.engine.rng`; recomputable:
:mod:`lightning_gpipe.engine.recompute`, replaying the module state its forward saw:
:class:`~lightning_gpipe.engine.recompute.ForwardState`) and sends in the order each peer takes
its messages (where the grid's stages take them in another order than sent,
:func:`~lightning_gpipe.schedule.in_send_order`, a send waits for its turn:
:func:`~lightning_gpipe.engine.plan.release`). The stage's module face (layers under the user's names, the
calls, the step's contracts) is :mod:`lightning_gpipe.engine.stage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine import aux_losses as aux
from lightning_gpipe.engine import backward_split as input_first
from lightning_gpipe.engine import recompute
from lightning_gpipe.engine.batchnorm import no_accumulate
from lightning_gpipe.engine.dtensor_wire import from_wire, to_wire
from lightning_gpipe.engine.microbatch import flatten, scatter, unflatten
from lightning_gpipe.engine.plan import ColumnPlan, StepRun, release
from lightning_gpipe.engine.rng import StageGenerator
from lightning_gpipe.engine.skip import MicroBatchStore, use_store
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.schedule import Action, Grid, Post, Step, Transfer
from lightning_gpipe.transport.failure import naming_errors
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.wire import Meta

__all__ = ["ColumnExecutor"]

_NO_SPAN = nullcontext()  # reusable: what a span is without a timeline


class ColumnExecutor:
    """Runs one stage's schedule column over a :class:`~lightning_gpipe.engine.plan.StepRun`.

    Owned by its :class:`~lightning_gpipe.engine.stage.PipelineStage`, which holds the step's control
    (the calls, the run in progress) and hands each run here.

    Args:
        layers: the stage's layers by name (the stage's own submodule dict, shared).
        virtual_layers: the names of each virtual stage's layers, in order.
        topology: stage index, stage count and neighbour ranks.
        chunks: number of micro-batches M (≥ 1).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        p2p: the transport.
        schedule: ``(stages, chunks[, virtual_stages]) -> Grid``.
        generator: the stage's own random stream (:mod:`lightning_gpipe.engine.rng`).
        calls: ``name -> call(layer, x)`` for the layers not applied as ``layer(x)`` (a plan's parts
            that pass several named tensors).
    """

    def __init__(
        self,
        layers: dict[str, nn.Module],
        virtual_layers: list[list[str]],
        topology: StageTopology,
        chunks: int,
        checkpoint: str,
        p2p: P2P,
        schedule: Callable[[int, int], Grid],
        generator: StageGenerator,
        calls: dict[str, Callable[[nn.Module, Any], Any]] | None = None,
    ) -> None:
        self.layers = layers
        self.calls = dict(calls or {})  # name -> call(layer, x), where a layer is not applied as layer(x)
        self.virtual_layers = virtual_layers
        self.topology = topology
        self.chunks = chunks
        # samples a training micro-batch holds at least where the batch has as many (2: micro_batch BN)
        self.min_micro_batch = 1
        self.checkpoint_mode = checkpoint
        self.p2p = p2p
        self.schedule = schedule
        self.generator = generator
        self.timeline: Any = None  # a tools.timeline.Timeline (anything with span(kind, i, u))
        self.tensor_mesh: Any = None  # the tensor-parallel mesh DTensors arrive on (.dtensor_wire)
        self.compiled: list[Any] | None = None  # per virtual stage, its layers compiled
        self.received_skips: list[tuple[str, int]] = []  # (name, source stage), for inspection and tests
        self._plans: dict[Any, ColumnPlan] = {}
        self.declared_aux = False  # whether the last training step's forwards declared aux losses
        self._modules_of: dict[int, list[list[Any]]] = {}  # per virtual stage (_submodules)
        # FSDP (lightning_gpipe.strategy.sharding): called before each B (virtual stage, the step's last B?)
        self.before_backward: Callable[[int, bool], None] | None = None
        self.split_backward = True  # False: no B split into input and weight gradients (FSDP reduces early)

    @property
    def virtual_stages(self) -> int:
        """v: the virtual stages this stage holds (1 without)."""
        return len(self.virtual_layers)

    def _span(self, kind: str, i: int, u: int = 0) -> Any:
        """Record ``kind`` (forward, recompute, backward, send, recv) of micro-batch ``i`` on virtual
        stage ``u`` on the timeline."""
        return self.timeline.span(kind, i, u) if self.timeline is not None else _NO_SPAN

    def local_forward(self, input: Any, store: MicroBatchStore | None = None, virtual_stage: int = 0) -> Any:
        """Virtual stage ``virtual_stage``'s layers (all of this stage's without virtual stages) applied
        in order, as ``nn.Sequential`` would, with ``store`` for skips; DTensors in what comes from or goes
        to another stage travel as :mod:`.dtensor_wire` says."""
        compiled, top, u = self.compiled, self.topology, virtual_stage
        if not (top.is_first and u == 0):  # DTensors travel as local tensors and placements
            input = from_wire(input, self.tensor_mesh)
        with use_store(store if store is not None else MicroBatchStore()):
            if compiled is not None:
                input = compiled[u](input)
            else:
                for name in self.virtual_layers[u]:
                    call = self.calls.get(name)
                    input = self.layers[name](input) if call is None else call(self.layers[name], input)
        return input if top.is_last and u == self.virtual_stages - 1 else to_wire(input)

    def start(self, input: Any, train: bool, micro: int | None) -> StepRun:
        """A new run at the step's first call: M from the split (first stage) or the first message;
        ``micro``: with one call per micro-batch, their number (``None``: one call per step)."""
        top = self.topology
        if top.is_first:
            least = self.min_micro_batch if train else 1
            parts, structure = scatter(input, self.chunks if micro is None else 1, min_size=least)
            run = self._new_run(train, len(parts) if micro is None else micro, micro is None)
            run.micro_batches = dict(enumerate(parts))
            run.in_structures = dict.fromkeys(range(len(parts)), structure)
            return run
        with self._span("recv", 0):  # M comes with the first message, which every column posts first
            first = self.p2p.recv(self._rank(top.stage - 1))
        if micro is not None and first[0].chunks != micro:
            raise RuntimeError(
                f"stage {top.stage} runs {micro} micro-batches but stage {top.stage - 1} sent "
                f"{first[0].chunks}; the stages split different batches"
            )
        run = self._new_run(train, first[0].chunks, micro is None)
        run.first = first
        expected = Post(Action("F", 0), Transfer(top.stage - 1))
        if run.column[0] != expected:  # with_posts posts the first message taken first
            raise AssertionError(f"stage {top.stage}'s column starts with {run.column[0]}, not {expected}")
        run.pos = 1  # that post was taken here
        return run

    def _new_run(self, train: bool, chunks: int, whole: bool) -> StepRun:
        top = self.topology
        plan = self._plan(chunks, train, whole)
        if whole and train and top.is_last and any(a.kind == "B" for a in plan.column[: plan.fill_end]):
            raise PipelineUsageError(
                "this schedule runs a backward on the last stage before its last forward "
                f"({list(plan.column)}); it needs the user's training_step once per micro-batch "
                "(GPipeStrategy(schedule=...) does that)"
            )
        run = StepRun(train, chunks, plan, whole)
        # sends wait for their turn where a peer takes them out of order (consumed: copied per run)
        run.order = {peer: list(keys) for peer, keys in plan.order.items()}
        run.outbox = {peer: {} for peer in run.order}
        return run

    def _plan(self, chunks: int, train: bool, whole: bool) -> ColumnPlan:
        """This stage's :class:`~lightning_gpipe.engine.plan.ColumnPlan` for M = ``chunks``, made
        once per shape."""
        top, v = self.topology, self.virtual_stages
        key = (self.schedule, top.stage, top.stages, top.skips, v, chunks, train, whole)
        plan = self._plans.get(key)
        if plan is None:
            grid = self.schedule(top.stages, chunks) if v == 1 else self.schedule(top.stages, chunks, v)  # type: ignore[call-arg]
            plan = self._plans[key] = ColumnPlan.of(grid, top, v, train, whole)
        return plan

    def _ready(self, action: Step, run: StepRun) -> bool:
        """Whether ``action`` can run now: what it needs from the user's code has come."""
        top, v = self.topology, self.virtual_stages
        if isinstance(action, Post):  # one call per step: a backward's message only once it has a loss
            return action.action is None or action.action.kind == "F" or not run.whole or run.step_loss
        if action.kind == "F":
            # a call gives micro-batch i: its input (virtual stage 0) or, on the last stage, its output
            # (the last virtual stage); the last stage's other forwards run ahead of the calls
            gated = action.virtual_stage == (v - 1 if top.is_last else 0)
            return action.i < run.called or not gated
        if action.kind == "W":  # its B ran before it; from drain_start on it waits for the drain
            return run.pos < run.plan.drain_start or run.step_loss
        if run.whole:
            return run.step_loss
        return action.i in run.losses or action not in run.plan.needs_loss

    def advance(self, run: StepRun) -> None:
        """Run ``run``'s column from the cursor while its actions are runnable."""
        while not run.done and self._ready(run.column[run.pos], run):
            self._execute(run.column[run.pos], run)
            run.pos += 1
            if run.pos == run.fill_end:  # no forward follows: what the fill left unchanged needs no copy
                for state in run.states:
                    state.prune()
                run.states = []
            if not run.whole:
                self.p2p.settle()  # a 1F1B stage frees what it sent as it goes
        if run.done and run.train:
            self.declared_aux = any(run.aux.values())
        if run.done and run.aux:
            values = [self._aux_weight(run, i) * sum(v) for i, v in run.aux.items() if v]
            if values:
                aux.add_recorded(sum(values))  # type: ignore[arg-type]
            run.aux = {}
        if run.done or run.whole:
            self.p2p.flush()

    def _submodules(self, u: int) -> list[list[Any]]:
        """Virtual stage ``u``'s modules by name (listed once: the stage's layers do not change)."""
        if u not in self._modules_of:
            self._modules_of[u] = aux.submodules({n: self.layers[n] for n in self.virtual_layers[u]})
        return self._modules_of[u]

    def _weigh(self, run: StepRun, i: int) -> None:
        """Micro-batch ``i``'s aux losses take its weight in the backward that follows."""
        if i in run.aux_cells:
            run.aux_cells[i][0] = self._aux_weight(run, i)

    @staticmethod
    def _aux_weight(run: StepRun, i: int) -> float:
        """Micro-batch ``i``'s aux losses' weight: the strategy's, or its share of the sizes forwarded."""
        if run.aux_weights is not None:
            return run.aux_weights[i]
        return run.sizes.get(i, 1) / max(sum(run.sizes.values()), 1)

    def _execute(self, action: Step, run: StepRun) -> None:
        """Run one action of this stage's column: a :class:`~lightning_gpipe.schedule.Post`, ``F i``,
        ``B i`` or ``W i``."""
        if isinstance(action, Post):
            self.p2p.post(self._rank(action.transfer.peer))
        elif action.kind == "F":
            self._forward_one(action, run)
        elif action.kind == "B":
            if self.before_backward is not None:
                self.before_backward(action.virtual_stage, run.last_backward(action.virtual_stage))
            self._backward_one(action, run)
        else:
            self._weights_one(action, run)

    def _forward_one(self, action: Action, run: StepRun) -> None:
        """``F i``: receive micro-batch ``i`` and its skips, compute it, send it and its skips on."""
        top, i, u, v = self.topology, action.i, action.virtual_stage, self.virtual_stages
        key = (i, u)
        first_part = top.is_first and u == 0
        last_part = top.is_last and u == v - 1
        x = run.micro_batches.pop(i) if first_part else ()
        x_structure = run.in_structures.pop(i) if first_part else None
        run.forwarded.add(key)
        store = MicroBatchStore()
        received = run.plan.receives[action]
        for t in received:
            meta, tensors = self._receive(t, i, u, run)
            if t.skip is None:
                x, x_structure = _as_inputs(meta, tensors, run.train), meta.structure
            else:
                store[t.skip] = _as_inputs(meta, tensors, run.train)[0]
                self.received_skips.append((t.skip, t.peer))
        assert x_structure is not None  # the first stage's split, or the message's
        records = run.aux.setdefault(i, []) if run.train else []
        cell = run.aux_cells.setdefault(i, [1.0])  # the weight its aux losses take, set before its backward
        with self._span("forward", i, u), self._naming_errors("forward", i, x), self.generator.drawing():
            with aux.recording_aux(records, cell):
                y = self._compute(i, u, run, unflatten(x_structure, x), store)
        if run.train:
            run.sizes[i] = next((t.shape[0] for t, w in zip(x, x_structure.whole) if not w and t.dim()), 1)
            if i == 0 and not top.is_last:  # there training_step never reads what its layers keep
                aux.check_stored_graph_tensors(self._submodules(u), top.stage)
        kept = [t for t, whole in zip(x, x_structure.whole) if whole]  # replicated, stay so passed on
        y_tensors, y_structure = flatten(y, f"output of pipeline stage {top.stage}", kept)
        sent = run.plan.sends[action]
        if run.train:
            run.inputs[key] = x
            run.skips_in[key] = {t.skip: store[t.skip] for t in received if t.skip is not None}
            run.skips_out[key] = {t.skip: store[t.skip] for t in sent if t.skip is not None}
        if run.train or last_part:
            run.outputs[key] = y_tensors
            run.out_structures[key] = y_structure
        for t in sent:  # the output first, then the skips: the order in which they are received
            payload = y_tensors if t.skip is None else (store[t.skip],)
            self._send(run, action, t, payload, structure=y_structure if t.skip is None else None)

    def _receive(self, t: Transfer, i: int, u: int, run: StepRun) -> tuple[Meta, list[Tensor]]:
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

    def _compute(self, i: int, u: int, run: StepRun, x: Any, store: MicroBatchStore) -> Any:
        """Virtual stage ``u``'s layers on micro-batch ``i``, recomputable under ``checkpoint``."""
        if not (run.train and recompute.recomputes(self.checkpoint_mode, i, run.chunks)):
            return self.local_forward(x, store, u)
        # what this forward changes, it changes once (the recompute replays it); the layers, not the
        # stage: iterating the stage inside a step is refused
        layers = self._virtual_modules(u)
        state = recompute.ForwardState.capture(layers)
        run.states.append(state)
        return recompute.run(
            partial(self.local_forward, virtual_stage=u),
            x,
            store,
            context=lambda: self._recompute_context(i, u, state, layers),
        )

    def _virtual_modules(self, u: int) -> list[nn.Module]:
        """Virtual stage ``u``'s layers (all of the stage's without virtual stages)."""
        return [self.layers[name] for name in self.virtual_layers[u]]

    def _send(self, run: StepRun, action: Action, t: Transfer, payload: Any, **options: Any) -> None:
        """Send what ``action`` sends over ``t`` (a backward's ``payload`` is empty where no gradient
        flows: every message the schedule names travels), in the order the peer takes its
        messages: where a grid's stages take them in another order than sent
        (:func:`~lightning_gpipe.schedule.send_order`), a message waits here for its turn."""
        order = run.order.get(t.peer)
        key = (action.kind, action.i, action.virtual_stage, t.skip)
        item = (payload, options, action.i, action.virtual_stage)
        ready = [item] if order is None else release(order, run.outbox[t.peer], key, item)
        for ready_payload, ready_options, ready_i, ready_u in ready:
            with self._span("send", ready_i, ready_u):
                self.p2p.send(ready_payload, self._rank(t.peer), chunks=run.chunks, **ready_options)

    def _naming_errors(self, phase: str, i: int, x: Sequence[Tensor]) -> Any:
        """Errors of this stage's layers re-raised as a
        :class:`~lightning_gpipe.transport.failure.StageError`."""
        first = next(iter(self.layers.values()), None)
        top = self.topology
        return naming_errors(top.stage, list(self.layers), first, phase, i, x, keep=(PipelineUsageError,))

    @contextmanager
    def _recompute_context(
        self, i: int, u: int, state: recompute.ForwardState, layers: Sequence[nn.Module]
    ) -> Iterator[None]:
        with self._span("recompute", i, u), state.replay(layers), no_accumulate():
            yield

    def _backward_one(self, action: Action, run: StepRun) -> None:
        """``B i``: receive the gradients of micro-batch ``i``'s outputs, backpropagate, send its
        inputs' gradients."""
        i, u = action.i, action.virtual_stage
        key = (i, u)
        y_grad = [t for t in run.outputs[key] if t.requires_grad]
        dy = list(run.take_leaf_grads(i)) if action in run.plan.needs_loss else []
        for t in run.plan.receives[action]:  # every one a message, empty where no gradient flows
            with self._span("recv", i, u):
                _, grads = self.p2p.recv(self._rank(t.peer))
            if t.skip is None:
                dy = grads
            elif grads:  # the gradient of a skip this stage sent on comes straight back
                y_grad, dy = [*y_grad, run.skips_out[key][t.skip]], [*dy, *grads]
        sends = run.plan.sends[action]
        sent = [run.inputs[key] if t.skip is None else (run.skips_in[key][t.skip],) for t in sends]
        sources = [[x for x in xs if x.requires_grad] for xs in sent]  # per send, what its gradients are of
        errors = partial(self._naming_errors, "backward", i, run.inputs[key])
        deferred = key in run.plan.deferred  # this column runs W i: B i is the input gradient only
        split_here = self.split_backward and (deferred or action == run.plan.input_first)
        wanted = split_here and bool(y_grad) and any(sources)
        if wanted:
            recomputed = recompute.recomputes(self.checkpoint_mode, i, run.chunks)
            modules, params = self._split_scope(run, u)
            wanted = input_first.splits(modules, recomputed, compiled=self.compiled is not None)
        split = None
        if y_grad and deferred and not any(sources):  # nothing to send: the whole backward at W i
            run.weights[key] = ("backward", partial(torch.autograd.backward, y_grad, dy))
        elif y_grad:  # the aux losses declared in its forward join it with the micro-batch's weight
            self._weigh(run, i)
            with self._span("backward", i, u), errors():
                if wanted:  # the input gradients leave before the weight gradients are computed
                    split = input_first.Split.of(y_grad, [x for xs in sources for x in xs], params)
                if split is not None:
                    flat = list(split.inputs(dy))
                else:
                    torch.autograd.backward(y_grad, dy)
        if split is not None:
            found = [[flat.pop(0) for _ in xs] for xs in sources]
        else:
            found = [[x.grad for x in xs] for xs in sources]
        for t, xs, gs in zip(sends, sources, found):
            dx = [g if g is not None else torch.zeros_like(x) for x, g in zip(xs, gs)]
            self._send(run, action, t, dx)
        if split is not None and deferred:
            run.weights[key] = ("weights", split.weights)
        elif split is not None:
            self._weights("weights", split.weights, i, u, errors)
        run.inputs[key] = run.outputs[key] = ()  # free this micro-batch
        run.skips_in[key] = run.skips_out[key] = {}

    def _split_scope(self, run: StepRun, u: int) -> tuple[list[nn.Module], list[Tensor]]:
        """Virtual stage ``u``'s modules (submodules included) and parameters, listed once a step."""
        scope = run.split_scopes.get(u)
        if scope is None:
            layers = self._virtual_modules(u)
            scope = input_first.every_module(layers), [p for layer in layers for p in layer.parameters()]
            run.split_scopes[u] = scope
        return scope

    def _weights_one(self, action: Action, run: StepRun) -> None:
        """``W i`` (``schedule="zb_h1"``): the weight gradients of micro-batch ``i``, whose ``B i``
        computed the input gradient only; the whole backward where ``B i`` sent nothing (the first
        stage, whose input needs no gradient, as ``torch.distributed.pipelining`` runs it; a
        "backward" span on the timeline); nothing
        where ``B i`` ran the whole backward (not split: :mod:`lightning_gpipe.engine.backward_split`)."""
        deferred = run.weights.pop((action.i, action.virtual_stage), None)
        if deferred is not None:
            errors = partial(self._naming_errors, "backward", action.i, ())
            self._weigh(run, action.i)
            self._weights(*deferred, action.i, action.virtual_stage, errors)

    def _weights(self, span: str, run: Callable[[], Any], i: int, u: int, errors: Callable[[], Any]) -> None:
        """``run`` the weight gradients (``span`` "weights") or a whole backward (``span`` "backward")
        of micro-batch ``i`` on virtual stage ``u``."""
        with self._span(span, i, u), errors():
            run()


def _as_inputs(meta: Meta, received: list[Tensor], train: bool) -> tuple[Tensor, ...]:
    """Received activations: floating and complex tensors the sender tracks gradients for get
    ``requires_grad``."""
    return tuple(
        t.requires_grad_(train and rg and (t.is_floating_point() or t.is_complex()))
        for t, (_, _, rg) in zip(received, meta.specs)
    )
