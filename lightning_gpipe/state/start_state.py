"""Every rank starts from global rank 0's weights, as every DDP replica does.

A model built on the meta device (each rank holds only its stage) starts instead from its own
stage's layers, materialized on the rank (:func:`start_stage`, :mod:`lightning_gpipe.state.materialize`).

**Weights.**
Each process builds the whole LightningModule; what it holds may differ between processes (an
unseeded script, or pretrained weights loaded only where ``LOCAL_RANK == 0``). DDP broadcasts
rank 0's parameters and buffers when it wraps the module; here, before the Sequential is cut,
global rank 0 (which holds the last stage of replica 0) sends each other stage of replica 0 that
stage's slice: its layers' parameters and buffers (persistent or not), one message per tensor.
Replicas ``d > 0`` then take replica 0's state over each stage's data-parallel group
(``GPipeStrategy.setup``).

Why slices and not one broadcast of the whole model: every rank receives only what it keeps, so
the traffic is ``P·(K-1)/K`` numbers out of rank 0 (a broadcast moves ``P`` to every rank) and the
receiving rank needs no memory beyond its own stage's ``≈P/K`` (no buffer for the rest). Rank 0
sends from the whole model it already holds (``P``); a rank that builds only its stage would
need nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_gpipe.partition.cut import cut
from lightning_gpipe.state.materialize import materialize_stage
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.p2p import P2P


def stage_tensors(layers: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, Tensor]]:
    """Parameters, then buffers, of ``layers`` (names relative to the Sequential; each tensor once)."""
    seen: set[int] = set()
    out: list[tuple[str, Tensor]] = []
    for kind in ("parameters", "buffers"):
        for layer_name, layer in layers:
            for name, t in getattr(layer, f"named_{kind}")():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"{layer_name}.{name}", t))
    return out


def send_rank0_state(
    stages: Sequence[Sequence[tuple[str, nn.Module]]], layout: Layout, rank: int, p2p: P2P
) -> None:
    """Give stage ``s`` of replica 0 rank 0's values of its layers' tensors, for every ``s``, on each of its
    tensor-parallel ranks (each takes the whole stage; the user's plan shards it after the cut).

    Every rank of replica 0 calls this; the other replicas return at once.

    Args:
        stages: the layers of each stage, cut from this rank's whole Sequential.
        layout: the rank layout (rank 0 holds the last stage of replica 0).
        rank: this process's global rank.
        p2p: the transport.

    Raises:
        ValueError: on a receiving rank, when its stage's tensors differ in number, shape or dtype
            from rank 0's (the module is built differently there).
    """
    if layout.stages * layout.tensors == 1 or layout.replica_of(rank) != 0:
        return
    if rank == 0:
        for s, k in ((s, k) for s in range(layout.stages) for k in range(layout.tensors)):
            dst = layout.rank(0, s, k)
            if dst == 0:  # the last stage is rank 0's own
                continue
            tensors = stage_tensors(stages[s])
            p2p.send([torch.tensor([len(tensors)], device=p2p.device)], dst)
            for _, t in tensors:
                p2p.send([t.detach().to(p2p.device)], dst)
            p2p.flush()
        return
    stage = layout.stage_of(rank)
    tensors = stage_tensors(stages[stage])
    _, (count,) = p2p.recv(0)
    if int(count) != len(tensors):
        raise ValueError(
            f"stage {stage} holds {len(tensors)} parameters and buffers, rank 0's copy of it {int(count)}; "
            "build the same module on every rank (load different weights, not a different architecture)"
        )
    for name, t in tensors:
        meta, (value,) = p2p.recv(0)
        if value.shape != t.shape or value.dtype != t.dtype:
            raise ValueError(
                f"{name} is {tuple(t.shape)} {t.dtype} on rank {rank} but {tuple(value.shape)} {value.dtype} "
                "on rank 0; build the same module on every rank"
            )
        with torch.no_grad():
            t.copy_(value)


def start_stage(
    model: nn.Module,
    name: str,
    sequential: nn.Sequential,
    balance: list[int],
    layout: Layout,
    rank: int,
    device: torch.device,
    stage_only: bool,
) -> None:
    """Give ``rank``'s stage of ``sequential`` (``name`` in ``model``) its starting weights.

    ``stage_only`` (built on the meta device): this stage's layers are materialized on ``device``
    (:func:`lightning_gpipe.state.materialize.materialize_stage`); otherwise every stage takes global rank
    0's weights (:func:`send_rank0_state`; replicas ``d > 0`` then take replica 0's in setup).
    """
    if stage_only:
        materialize_stage(model, name, sequential, balance, layout.stage_of(rank), device, layout.stages)
        return
    stages = [cut(sequential, balance, s, layout.stages) for s in range(layout.stages)]
    send_rank0_state(stages, layout, rank, P2P(device))
