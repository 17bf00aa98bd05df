"""One step's execution state on a stage: the cursor over its schedule column and what its
forwards keep per (micro-batch, virtual stage) until their backwards.

:class:`ColumnPlan` is what the column implies, the same for every step of the same shape: each
action's receives and sends (:func:`~lightning_gpipe.schedule.receives`,
:func:`~lightning_gpipe.schedule.sends`), which need the user's loss, and the order in which the
peers take this stage's messages. :class:`StepRun` is created at the step's first call
(:meth:`.ColumnExecutor._new_run`) and dropped when the column has run to its end or the step has no
loss. On the last stage, :class:`Call` records each call of the Sequential, so that the gradients
the user's loss leaves on the call's output leaves can be split per micro-batch.

**Sends held until their turn** (:func:`release`), where a peer takes this stage's messages in
another order than this stage's column sends them. That happens where
:func:`~lightning_gpipe.schedule.in_send_order` is false: interleaved 1F1B with two stages and a
micro-batch group of odd size, whose stages exchange activations and gradients in both directions.
The transport delivers one peer's messages in the order sent, so the sender holds each message
until those its peer takes before it have gone (:func:`~lightning_gpipe.schedule.send_order`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe import schedule
from lightning_gpipe.engine.microbatch import Structure
from lightning_gpipe.engine.recompute import ForwardState
from lightning_gpipe.schedule import Action, Grid, Step, Transfer
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.wire import Meta

__all__ = ["Call", "ColumnPlan", "Key", "StepRun", "release", "taking_order"]

Key = tuple[str, int, int, str | None]  # (kind, micro-batch, virtual stage here, skip) of a message sent


def taking_order(grid: Grid, topology: StageTopology, virtual_stages: int) -> dict[int, list[Key]]:
    """Per peer stage, the messages this stage sends it, in the order the peer takes them.

    Empty where every stage takes each peer's messages in the order sent (then nothing waits).
    """
    if schedule.in_send_order(grid, topology.skips):
        return {}
    top, v, orders = topology, virtual_stages, {}
    for peer in range(top.stages):
        taken: list[Key] = [
            (a.kind, a.i, t.virtual_stage, t.skip)
            for a in schedule.stage_actions(grid, peer)
            for t in schedule.receives(a, peer, top.stages, top.skips, v)
            if t.peer == top.stage
        ]
        if taken:
            orders[peer] = taken
    return orders


def release(order: list[Key], box: dict[Key, Any], key: Key, item: Any) -> list[Any]:
    """Hold ``item`` (the message ``key``) in ``box``; return, in ``order``, the held items whose
    turn has come.

    ``order`` and ``box`` are consumed: what is returned leaves both.
    """
    box[key] = item
    ready = []
    while order and order[0] in box:
        ready.append(box.pop(order.pop(0)))
    return ready


@dataclass(frozen=True)
class ColumnPlan:
    """What a stage's schedule column implies, computed once per step shape (K, M, v, training).

    Attributes:
        column: the stage's actions in order (only the forwards when not training), with the
            receives of their messages posted ahead (:class:`~lightning_gpipe.schedule.Post`,
            :func:`~lightning_gpipe.schedule.with_posts`) and, under one call per micro-batch on the
            stages before the last, the step outcome's as the last stage's message after its last one
            taken in the column (the outcome leaves right after the last stage's last call).
        fill_end: index after the column's last forward.
        receives: per action, the messages it takes, in order (:func:`~lightning_gpipe.schedule.receives`).
        sends: per action, the messages it sends, in order (:func:`~lightning_gpipe.schedule.sends`).
        needs_loss: the backwards that need the user's loss (:func:`~lightning_gpipe.schedule.needs_loss`).
        order: per peer stage, the keys of the messages this stage sends it in the order the peer
            takes them, where that differs from the order sent
            (:func:`taking_order`; empty when not training or where
            every peer takes them as sent).
        drain_start: index of the first action run in the step's drain (Lightning's ``backward``)
            rather than with the calls: on the last stage under one call per micro-batch, the
            weight passes after its last message, so that the step outcome it sends after its last
            call does not wait for them (the stages before wait for the outcome, not for them);
            ``len(column)`` elsewhere.
        input_first: the column's last backward that sends a gradient and has no ``W`` of its own,
            which sends it before it computes its weight gradients
            (:mod:`lightning_gpipe.engine.backward_split`); ``None``: none.
        deferred: ``(micro-batch, virtual stage)`` of each ``W`` in the column (``schedule="zb_h1"``):
            its ``B`` computes the input gradient only, its ``W`` the weight gradients.
    """

    column: tuple[Step, ...]
    fill_end: int
    receives: dict[Action, tuple[Transfer, ...]]
    sends: dict[Action, tuple[Transfer, ...]]
    needs_loss: frozenset[Action]
    order: dict[int, tuple[Key, ...]]
    drain_start: int
    input_first: Action | None = None
    deferred: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def of(
        cls, grid: Grid, topology: StageTopology, virtual_stages: int, train: bool, whole: bool = False
    ) -> ColumnPlan:
        """The plan of ``topology.stage``'s column of ``grid``; ``whole``: one call of the user's
        step covers every micro-batch (``schedule="gpipe"``), so the backwards' messages are posted
        from its first backward on (:func:`~lightning_gpipe.schedule.with_posts`).

        Raises:
            ValueError: the grid or the column with its posts does not validate
                (:func:`~lightning_gpipe.schedule.validate`).
        """
        top, v = topology, virtual_stages
        actions = [a for a in schedule.stage_actions(grid, top.stage) if train or a.kind == "F"]
        # one call per micro-batch: the step outcome's receive is posted ahead too (Post with no action)
        outcome = top.stages - 1 if train and not whole and not top.is_last else None
        column = schedule.with_posts(actions, top.stage, top.stages, top.skips, v, whole, outcome)
        schedule.validate(grid, {top.stage: column}, top.skips)
        order = taking_order(grid, top, v) if train and v > 1 else {}
        sends = {a: tuple(schedule.sends(a, top.stage, top.stages, top.skips, v)) for a in actions}
        receives = {a: tuple(schedule.receives(a, top.stage, top.stages, top.skips, v)) for a in actions}
        deferred = frozenset((a.i, a.virtual_stage) for a in actions if a.kind == "W")
        drain_start = len(column)
        if train and not whole and top.is_last:  # the trailing weight passes wait for the drain
            while isinstance(column[drain_start - 1], Action) and column[drain_start - 1].kind == "W":
                drain_start -= 1
        return cls(
            column=tuple(column),
            fill_end=1 + max(k for k, a in enumerate(column) if a.kind == "F"),
            receives=receives,
            sends=sends,
            needs_loss=frozenset(a for a in actions if schedule.needs_loss(a, top.stage, top.stages, v)),
            order={peer: tuple(keys) for peer, keys in order.items()},
            input_first=next(
                (
                    a
                    for a in reversed(actions)
                    if a.kind == "B" and sends[a] and (a.i, a.virtual_stage) not in deferred
                ),
                None,
            ),
            deferred=deferred,
            drain_start=drain_start,
        )


@dataclass
class Call:
    """Last stage: one call of the step, for splitting its leaves' gradients per micro-batch."""

    covered: list[int]  # the micro-batches it covered
    sizes: list[list[int]]  # per leaf, its parts' dim-0 sizes
    leaves: tuple[Tensor, ...]  # the detached outputs given to the user
    whole: tuple[bool, ...]  # per leaf: replicated (micro-batch 0's), not joined


@dataclass
class StepRun:
    """One step's execution state: where the cursor stands, the micro-batches and what the forward keeps."""

    train: bool
    chunks: int
    plan: ColumnPlan  # this stage's column and what each action receives and sends
    whole: bool  # one call covers every micro-batch (schedule="gpipe"); else one call per micro-batch
    micro_batches: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)  # first stage: given inputs
    in_structures: dict[int, Structure] = field(default_factory=dict)  # first stage: how they make values
    first: tuple[Meta, list[Tensor]] | None = None  # other stages: micro-batch 0's message, taken early
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
    step_loss: bool = False  # Lightning's backward has come (the drain: ColumnPlan.drain_start)
    pos: int = 0  # the cursor: index of the next action in column
    states: list[ForwardState] = field(default_factory=list)  # recomputed micro-batches' module states
    # (micro-batch, virtual stage) -> ("weights", its backward's second pass) or, where its B sent
    # nothing, ("backward", the whole backward), due at its W (schedule="zb_h1")
    weights: dict[tuple[int, int], tuple[str, Callable[[], Any]]] = field(default_factory=dict)
    # last stage, per call: the micro-batches it covered, each leaf's part sizes, the leaves given to
    # the user and which of them are replicated (micro-batch 0's)
    calls: list[Call] = field(default_factory=list)
    leaf_grads: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    # aux losses (lightning_gpipe.engine.aux_losses): each micro-batch's size and declared values, and the
    # weights the strategy gives them (one call per micro-batch; None: n_i / sum of sizes)
    sizes: dict[int, int] = field(default_factory=dict)
    aux: dict[int, list[Tensor]] = field(default_factory=dict)
    aux_cells: dict[int, list[float]] = field(default_factory=dict)  # the weight each one's backward reads
    aux_weights: list[float] | None = None
    # a grid whose stages take a peer's messages in another order than it sends them
    # (schedule.in_send_order false): per peer stage, the keys (kind, i, virtual stage here, skip)
    # in the order the peer takes them (taking_order); sends wait in outbox until their turn (release)
    order: dict[int, list[tuple[str, int, int, str | None]]] = field(default_factory=dict)
    outbox: dict[int, dict[tuple[str, int, int, str | None], Any]] = field(default_factory=dict)
    # per virtual stage: its modules (submodules included) and parameters, listed at the step's first
    # backward that may be split (lightning_gpipe.engine.backward_split)
    split_scopes: dict[int, tuple[list[nn.Module], list[Tensor]]] = field(default_factory=dict)

    @property
    def column(self) -> tuple[Step, ...]:
        """This stage's actions (only the forwards when not training), with their posts."""
        return self.plan.column

    @property
    def fill_end(self) -> int:
        """Index after the column's last forward."""
        return self.plan.fill_end

    @property
    def done(self) -> bool:
        return self.pos == len(self.plan.column)

    def last_backward(self, virtual_stage: int) -> bool:
        """Whether no ``B`` of ``virtual_stage`` follows the cursor's action in the column."""
        return not any(
            isinstance(a, Action) and a.kind == "B" and a.virtual_stage == virtual_stage
            for a in self.plan.column[self.pos + 1 :]
        )

    def take_leaf_grads(self, i: int) -> tuple[Tensor, ...]:
        """Last stage: the gradients the user's loss left on micro-batch ``i``'s part of its call's
        leaves: a joined leaf's split as it was joined, a replicated leaf's to the call's first
        micro-batch (zeros to the others)."""
        if i not in self.leaf_grads:
            call = next(c for c in self.calls if i in c.covered)
            self.calls.remove(call)  # the leaves are not needed again: their gradients are split here
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
            self.leaf_grads.update({k: tuple(v) for k, v in per.items()})
        return self.leaf_grads.pop(i)
