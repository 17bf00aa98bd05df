"""Asynchronous point-to-point operations by global rank, posted on the process group itself.

``torch.distributed.isend``/``irecv`` look up the default group, translate the global rank and
check the tensor on every call; a stage posts two to four operations per message, each between two
matmuls where every line of Python runs with cold caches, so these post on the group directly
(``ProcessGroup.send``/``recv``) with each group's ranks looked up once (:func:`_on_group`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe._compat import profiler_enabled, unrecorded

__all__ = ["irecv", "isend"]

_RANKS: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
"""Per process group, the group rank of each global rank (weak: a group's sockets close only once
nothing holds it, :class:`~lightning_gpipe.transport.p2p.Lanes`)."""


def _on_group(group: Any, rank: int) -> tuple[Any, int]:
    """The process group ``group`` names (``None``: the default group) and global rank ``rank``'s
    rank in it.

    Raises:
        KeyError: ``rank`` is not in ``group``.
    """
    if group is None:
        return dist.group.WORLD, rank
    ranks = _RANKS.get(group)
    if ranks is None:
        ranks = _RANKS[group] = {r: k for k, r in enumerate(dist.get_process_group_ranks(group))}
    return group, ranks[rank]


def isend(t: Tensor, dst: int, group: Any = None, tag: int = 0) -> dist.Work:
    """``torch.distributed.isend(t, dst, group, tag)`` (``dst`` a global rank) that opens no
    profiler event while ``torch.profiler`` runs (:func:`lightning_gpipe._compat.unrecorded`: the
    send may complete after the profiler's next cycle began)."""
    pg, peer = _on_group(group, dst)
    tensors = [torch.view_as_real(t) if t.is_complex() else t]
    if not profiler_enabled():
        return pg.send(tensors, peer, tag)
    with unrecorded():
        return pg.send(tensors, peer, tag)


def irecv(t: Tensor, src: int, group: Any = None, tag: int = 0) -> dist.Work:
    """``torch.distributed.irecv(t, src, group, tag)`` (``src`` a global rank)."""
    pg, peer = _on_group(group, src)
    return pg.recv([torch.view_as_real(t) if t.is_complex() else t], peer, tag)
