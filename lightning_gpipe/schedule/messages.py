"""The messages each action implies: what it receives and sends, from and to which stage, in which order.

Each stage's executor (:class:`lightning_gpipe.engine.stage.PipelineStage`) receives and sends exactly
the messages :func:`receives` and :func:`sends` name. With virtual stages, part ``c`` sends its output to part
``c+1`` on stage ``(c+1) mod K`` (the last stage's virtual stage ``u`` to stage 0's virtual stage
``u+1``), and each :class:`Transfer` names the peer's virtual stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from lightning_gpipe.schedule.grid import Action, Grid, holder, part, stage_actions, virtual_stages_of

__all__ = [
    "SkipRoute",
    "Transfer",
    "in_send_order",
    "receives",
    "send_order",
    "sends",
]


class SkipRoute(Protocol):
    """A skip connection (:class:`lightning_gpipe.engine.skip.Route`): stashed on ``source``, popped
    on ``target``."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> int: ...

    @property
    def target(self) -> int: ...


@dataclass(frozen=True)
class Transfer:
    """One message an action receives or sends.

    Attributes:
        peer: the other stage's index.
        skip: ``None`` for the stage boundary's tensors (activations in a forward, their
            gradients in a backward); else the name of a skip connection (its tensor in a
            forward, its gradient in a backward).
        virtual_stage: the peer's virtual stage that sends or receives it (0 without virtual
            stages).
    """

    peer: int
    skip: str | None = None
    virtual_stage: int = 0


def _transfer(other: int, stages: int, skip: str | None = None) -> Transfer:
    """The transfer to or from model part ``other``: its stage and virtual stage."""
    stage, virtual_stage = holder(other, stages)
    return Transfer(stage, skip, virtual_stage)


def receives(
    action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = (), virtual_stages: int = 1
) -> list[Transfer]:
    """The messages ``action`` on ``stage`` receives, in the order it takes them.

    Forward: the part's input from the previous part, then each skip popped here from its
    stashing part. Backward: the output's gradient from the next part, then the gradient of
    each skip stashed here from its popping part. (On the last part the output's gradient
    comes from the user's loss, not a message.) ``W``: nothing. At run time a gradient message flows only for
    tensors that require a gradient. With virtual stages, skip routes name parts
    (:func:`part`); part ``c``'s next part ``c+1`` lives on stage ``(c+1) mod K``, so the last
    stage's virtual stage ``u`` sends to stage 0's virtual stage ``u+1``.
    """
    if action.kind == "W":
        return []  # the weight gradients: from what its B received
    skips = list(skips)
    c, last = part(stage, action.virtual_stage, stages), stages * virtual_stages - 1
    if action.kind == "F":
        first = [_transfer(c - 1, stages)] if c > 0 else []
        return first + [_transfer(r.source, stages, r.name) for r in skips if r.target == c and r.source != c]
    first = [_transfer(c + 1, stages)] if c < last else []
    return first + [_transfer(r.target, stages, r.name) for r in skips if r.source == c and r.target != c]


def sends(
    action: Action, stage: int, stages: int, skips: Iterable[SkipRoute] = (), virtual_stages: int = 1
) -> list[Transfer]:
    """The messages ``action`` on ``stage`` sends, in order: the mirror of :func:`receives`.

    Forward: the output to the next part, then each skip stashed here to its popping part.
    Backward: the input's gradient to the previous part, then the gradient of each skip popped
    here to its stashing part. ``W``: nothing.
    """
    if action.kind == "W":
        return []  # the weight gradients stay on the stage
    skips = list(skips)
    c, last = part(stage, action.virtual_stage, stages), stages * virtual_stages - 1
    if action.kind == "F":
        first = [_transfer(c + 1, stages)] if c < last else []
        return first + [_transfer(r.target, stages, r.name) for r in skips if r.source == c and r.target != c]
    first = [_transfer(c - 1, stages)] if c > 0 else []
    return first + [_transfer(r.source, stages, r.name) for r in skips if r.target == c and r.source != c]


def send_order(
    grid: Grid, stage: int, peer: int, skips: Iterable[SkipRoute] = ()
) -> list[tuple[Action, Transfer]]:
    """The messages ``peer`` sends ``stage`` in one step, in the order ``peer`` sends them.

    Each is named as ``stage`` takes it: ``(the action on stage that receives it, the transfer
    as that action's`` :func:`receives` ``names it)``. The transport delivers one peer's
    messages in the order sent; where a stage takes them in another order
    (:func:`in_send_order` is false: interleaved 1F1B with two stages and a micro-batch group of
    odd size, whose stages exchange activations and gradients in both directions), the stage
    receives them in this order and holds each until its action runs. ``grid`` gives the
    number of virtual stages (:func:`virtual_stages_of`).
    """
    k, v = len(grid[0]) if grid else 0, virtual_stages_of(grid)
    skips = list(skips)
    return [
        (Action(a.kind, a.i, t.virtual_stage), Transfer(peer, t.skip, a.virtual_stage))
        for a in stage_actions(grid, peer)
        for t in sends(a, peer, k, skips, v)
        if t.peer == stage
    ]


def in_send_order(grid: Grid, skips: Iterable[SkipRoute] = ()) -> bool:
    """Whether every stage's column takes each peer's messages in the order the peer sends them.

    True for :func:`fill_drain` and, with three or more stages, for :func:`interleaved_1f1b`
    (each ordered pair of stages then carries one kind of message); see :func:`send_order`.
    """
    k, v = len(grid[0]) if grid else 0, virtual_stages_of(grid)
    skips = list(skips)
    for stage in range(k):
        taken = [(a, t) for a in stage_actions(grid, stage) for t in receives(a, stage, k, skips, v)]
        for peer in range(k):
            if [x for x in taken if x[1].peer == peer] != send_order(grid, stage, peer, skips):
                return False
    return True
