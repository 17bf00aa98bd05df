"""The default process group through Lightning: its rendezvous, and Lightning's reduce over a group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe._lightning import (
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
    sync_ddp,
)
from lightning_gpipe.transport import arrival, liveness
from lightning_gpipe.transport.layout import Layout

__all__ = ["connect", "reduce"]


def connect(
    cluster_environment: Any,
    backend: str | None,
    timeout: timedelta | None,
    device: torch.device,
    layout: Layout | None = None,
) -> str:
    """Initialize the default process group (Lightning's rendezvous) and start this rank's heartbeat
    (:mod:`lightning_gpipe.transport.liveness`; ``layout`` names the ranks' stages in its messages).

    Returns:
        The backend: ``backend``, or by default the one Lightning picks for ``device``.
    """
    backend = backend or default_process_group_backend(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    arrival.reset()
    init_dist_connection(cluster_environment, backend, **kwargs)
    liveness.start(dist.get_rank(), layout)
    return backend


def reduce(tensor: Any, group: Any, reduce_op: Any = "mean") -> Any:
    """``tensor`` reduced over ``group`` (Lightning's ``_sync_ddp``); as it is without a group to
    reduce over."""
    if not isinstance(tensor, torch.Tensor) or not distributed_is_initialized():
        return tensor
    if group is None or dist.get_rank(group) < 0 or dist.get_world_size(group) == 1:
        return tensor  # not a member (a stage without losses or metrics: they reach it shared), or alone
    return sync_ddp(tensor, group, reduce_op=reduce_op)
