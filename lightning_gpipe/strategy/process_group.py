"""The default process group through Lightning: its rendezvous, and Lightning's reduce over a group."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_gpipe._lightning import (
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
    sync_ddp,
)
from lightning_gpipe.partition import tied
from lightning_gpipe.transport import arrival, failure, groups, liveness, rendezvous
from lightning_gpipe.transport.layout import Layout

__all__ = ["connect", "disconnect", "reduce"]


def connect(
    cluster_environment: Any,
    backend: str | None,
    timeout: timedelta | None,
    device: torch.device,
    layout: Layout | None = None,
) -> str:
    """Initialize the default process group and start this rank's heartbeat
    (:mod:`lightning_gpipe.transport.liveness`; ``layout`` names the ranks' stages in its messages).

    The job's first entry call (``fit``, ``validate``, ``test``, ``predict``) connects through
    Lightning's rendezvous. Each later one waits for every rank and keeps the connection when every
    rank's is intact, as DDP does; after a failure (caught, and followed by another call) every rank
    tears it down (:func:`disconnect`) and connects afresh over the job's store
    (:mod:`lightning_gpipe.transport.rendezvous`).

    Returns:
        The backend: ``backend``, or by default the one Lightning picks for ``device``.

    Raises:
        RendezvousError: a later entry call where a rank of the job has ended (it will never come).
    """
    backend = backend or default_process_group_backend(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    if rendezvous.joined():
        rank, world = cluster_environment.global_rank(), cluster_environment.world_size()
        if rendezvous.gather(rank, world, timeout or default_pg_timeout, intact=distributed_is_initialized()):
            return backend  # every rank's connection is intact: kept, with its heartbeat and counts
        disconnect()
        rendezvous.reconnect(backend, rank, world, **kwargs)
    else:
        rendezvous.check_started()
        failure.point_at_reports()  # wrapped in init's "[rank R]" prefix, as the hook rendezvous restores
        hook = sys.excepthook
        init_dist_connection(cluster_environment, backend, **kwargs)
        rendezvous.join(hook)
    arrival.reset()
    liveness.start(dist.get_rank(), layout)
    return backend


def disconnect() -> None:
    """Tear this rank's connection down: stop its heartbeat (saying it leaves), destroy the default
    process group and every group made from it, and drop their handles (the groups in reference
    cycles go with the next garbage collection). The job's store stays."""
    liveness.stop()
    tied.forget_tied_groups()
    groups.close_all(collect=False)


def reduce(tensor: Any, group: Any, reduce_op: Any = "mean") -> Any:
    """``tensor`` reduced over ``group`` (Lightning's ``_sync_ddp``); as it is without a group to
    reduce over."""
    if not isinstance(tensor, torch.Tensor) or not distributed_is_initialized():
        return tensor
    if group is None or dist.get_rank(group) < 0 or dist.get_world_size(group) == 1:
        return tensor  # not a member (a stage without losses or metrics: they reach it shared), or alone
    return sync_ddp(tensor, group, reduce_op=reduce_op)
