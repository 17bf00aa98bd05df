"""The outbox: sends held until their turn, where a peer takes this stage's messages in another
order than this stage's column sends them.

That happens where :func:`~lightning_gpipe.schedule.in_send_order` is false: interleaved 1F1B
with two stages and a micro-batch group of odd size, whose stages exchange activations and
gradients in both directions. The transport delivers one peer's messages in the order sent, so
the sender holds each message until those its peer takes before it have gone
(:func:`~lightning_gpipe.schedule.send_order`).
"""

from __future__ import annotations

from typing import Any

from lightning_gpipe import schedule
from lightning_gpipe.schedule import Grid
from lightning_gpipe.transport.layout import StageTopology

__all__ = ["Key", "release", "taking_order"]

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
