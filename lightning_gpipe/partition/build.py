"""One rank's :class:`~lightning_gpipe.engine.stage.PipelineStage`, built from its cut of the model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_gpipe import schedule
from lightning_gpipe._compat import children
from lightning_gpipe.engine.skip import routes
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.partition.cut import virtual_cut
from lightning_gpipe.schedule import Grid
from lightning_gpipe.transport.layout import Layout, layer_parts
from lightning_gpipe.transport.p2p import P2P, Lanes

__all__ = ["build_stage"]


def build_stage(
    seq: nn.Sequential,
    balance: Sequence[int],
    layout: Layout,
    rank: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
    schedule: Callable[[int, int], Grid] = schedule.fill_drain,
    lanes: Lanes | None = None,
) -> PipelineStage:
    """Global rank ``rank``'s :class:`PipelineStage` of ``seq`` cut by ``balance`` (layers shared, not
    copied), running ``schedule`` (a function of :data:`lightning_gpipe.schedule.SCHEDULES`), its
    messages on ``lanes`` (:class:`~lightning_gpipe.transport.p2p.Lanes`; ``None``: the default group).

    With virtual stages, ``balance`` has ``K·v`` entries (one per part) and the stage holds
    parts ``j, j+K, …`` as its virtual stages (:func:`~lightning_gpipe.partition.cut.virtual_cut`);
    skip routes name parts. ``seq`` may be a :class:`~lightning_gpipe.partition.plan_chain.PlanChain`
    (a plan's parts, under the root's own dotted names); its ``calls`` go to the stage.
    """
    topology = layout.topology(rank, tuple(routes(seq, layer_parts(balance))))
    per_virtual = virtual_cut(seq, balance, topology.stage, layout.stages)
    layers = [pair for part in per_virtual for pair in part]
    names = list(children(seq))
    virtual_layers = [[n for n, _ in part] for part in per_virtual]
    p2p = P2P(device, lanes=lanes)
    calls = getattr(seq, "calls", None)  # a plan's parts that pass several named tensors (PlanChain)
    return PipelineStage(layers, topology, chunks, checkpoint, p2p, names, schedule, virtual_layers, calls)
