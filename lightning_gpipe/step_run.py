"""One step's execution state on a stage: the cursor over its schedule column and what its
forwards keep per (micro-batch, virtual stage) until their backwards.

:class:`StepRun` is created at the step's first call (:meth:`.ColumnExecutor._new_run`) and
dropped when the column has run to its end or the step has no loss. On the last stage,
:class:`Call` records each call of the Sequential, so that the gradients the user's loss leaves on
the call's output leaves can be split per micro-batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_gpipe.effects import ForwardState
from lightning_gpipe.microbatch import Structure
from lightning_gpipe.schedule import Action
from lightning_gpipe.wire import Meta

__all__ = ["Call", "StepRun"]


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
    # messages that follow the step's calls, per stage (the last stage's step outcome): announced
    # with the stretch that ends where the calls end, so that they are taken in the background
    after_calls: Counter[int] = field(default_factory=Counter)
    states: list[ForwardState] = field(default_factory=list)  # recomputed micro-batches' module states
    # last stage, per call: the micro-batches it covered, each leaf's part sizes, the leaves given to
    # the user and which of them are replicated (micro-batch 0's)
    calls: list[Call] = field(default_factory=list)
    leaf_grads: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    # a grid whose stages take a peer's messages in another order than it sends them
    # (schedule.in_send_order false): per peer stage, the keys (kind, i, virtual stage here, skip)
    # in the order the peer takes them (lightning_gpipe.outbox); sends wait in outbox until their turn
    order: dict[int, list[tuple[str, int, int, str | None]]] = field(default_factory=dict)
    outbox: dict[int, dict[tuple[str, int, int, str | None], Any]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.pos == len(self.column)
