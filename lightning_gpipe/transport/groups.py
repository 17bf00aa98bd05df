"""Process groups: world-wide collectives, the pipeline and
data-parallel groups, and their destruction when the process exits.

Each rank holds four group handles (:class:`Groups`): its pipeline, its stage's data-parallel
replicas, its stage's tensor-parallel ranks, and the last stage's replicas; the
:class:`~torch.distributed.device_mesh.DeviceMesh` over the first three; on Gloo also its pipeline's
:class:`~lightning_gpipe.transport.p2p.Lanes` (one group per direction for the stages' messages).
They are made once per default group and layout (:func:`new_groups`) and destroyed, with the default
group, by an exit hook (:func:`close_at_exit`) while Python still runs. The world-wide collectives
(:func:`barrier`, :func:`broadcast_object`, :func:`all_agree`) do nothing before
``torch.distributed`` is initialized, as Lightning's strategies do.
"""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.transport.arrival import arrive
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.mesh import device_mesh
from lightning_gpipe.transport.p2p import Lanes, release_connections
from lightning_gpipe.transport.send_waiter import join_sends

__all__ = [
    "initialized",
    "EXIT_WAIT_S",
    "Groups",
    "all_agree",
    "barrier",
    "broadcast_object",
    "close_all",
    "close_at_exit",
    "new_groups",
]

log = logging.getLogger(__name__)


def initialized() -> bool:
    """Whether the default process group exists (``torch.distributed`` is available and initialized)."""
    return dist.is_available() and dist.is_initialized()


def tensors_to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested dict/list to CPU (for gathering with object collectives); a ``DTensor``
    must be made whole first (:func:`lightning_gpipe.state.dtensors.full_tensors`)."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to_cpu(v) for v in obj)
    return obj


def arrive_all(operation: str, timeout: float) -> None:
    """Every rank reaches ``operation`` within ``timeout`` seconds, or it fails naming those missing
    (:func:`lightning_gpipe.transport.arrival.arrive`); nothing to wait for outside ``torch.distributed``."""
    if initialized():
        arrive(operation, timeout)


def barrier(device: torch.device) -> None:
    """Wait for every rank (on NCCL, on ``device``)."""
    if not initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (default: all; picklable objects)."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group)
    return box[0]


def from_last_stage(obj: Any, layout: Layout, rank: int, group: Any) -> Any:
    """``obj`` of ``rank``'s pipeline's last stage, on every stage of the pipeline (``group``: one
    tensor-parallel rank's; tensors on CPU)."""
    if layout.stages == 1 or group is None or not initialized():
        return obj
    src = layout.rank(layout.replica_of(rank), layout.stages - 1, layout.tensor_of(rank))
    shared = broadcast_object(tensors_to_cpu(obj) if rank == src else None, src, group)
    return obj if rank == src else shared


def all_agree(decision: bool, device: torch.device, everyone: bool = True) -> bool:
    """Whether every rank (``everyone``) or any rank decided ``True``."""
    if not initialized():
        return decision
    t = torch.tensor(int(decision), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return bool(t == dist.get_world_size()) if everyone else bool(t)


@dataclass
class Groups:
    """The process groups a rank uses besides point-to-point.

    Attributes:
        pipeline: this rank's pipeline (all stages of its replica); global-norm clipping, metric sharing.
        data: this rank's stage in every replica; gradient all-reduce.
        last_stage_data: the last stage in every replica (``None`` on other ranks' behalf is
            never needed: it is a group handle every rank holds); ``sync_dist`` logging, torchmetrics.
        lanes: the groups this rank's pipeline sends its stages' messages on, one per direction
            (Gloo with two stages or more; ``None``: the default group, as on NCCL, whose
            point-to-point operations have a communicator per pair of ranks already).
        tensor: this rank's stage in its replica (its tensor-parallel peers; itself alone when T = 1).
        mesh: the :class:`~torch.distributed.device_mesh.DeviceMesh` over ``pipeline``, ``data`` and
            ``tensor`` (:func:`lightning_gpipe.transport.mesh.device_mesh`).
    """

    pipeline: Any
    data: Any
    last_stage_data: Any
    lanes: Lanes | None = None
    tensor: Any = None
    mesh: Any = None


_GROUPS: dict[tuple[int, int, int, int, str], tuple[dict[Any, Any], ...]] = {}


def new_groups(layout: Layout, rank: int, device_type: str = "cpu") -> Groups:
    """Create every pipeline, data-parallel and tensor-parallel group and this rank's device mesh
    (all ranks must call this, in the same order).

    Groups are made once per process group and layout, so repeated ``fit``/``validate`` calls in
    one job reuse them.
    """
    key = (id(dist.group.WORLD), layout.world_size, layout.stages, layout.tensors, device_type)
    d_, s_, t_ = range(layout.replicas), range(layout.stages), range(layout.tensors)
    if key not in _GROUPS:
        pipelines = {(d, t): dist.new_group(layout.pipeline_ranks(d, t)) for d in d_ for t in t_}
        datas = {(s, t): dist.new_group(layout.data_ranks(s, t)) for s in s_ for t in t_}
        lanes = new_lanes(layout)
        tensors = {(d, s): dist.new_group(layout.tensor_ranks(d, s)) for d in d_ for s in s_}
        _GROUPS[key] = (pipelines, datas, lanes, tensors, {})
    pipelines, datas, lanes, tensors, meshes = _GROUPS[key]
    replica, stage, tensor = layout.replica_of(rank), layout.stage_of(rank), layout.tensor_of(rank)
    mine = (pipelines[replica, tensor], datas[stage, tensor], tensors[replica, stage])
    if rank not in meshes:
        meshes[rank] = device_mesh(layout, device_type, *mine)
    return Groups(
        pipeline=mine[0],
        data=mine[1],
        last_stage_data=datas[layout.stages - 1, tensor],
        lanes=lanes[replica, tensor],
        tensor=mine[2],
        mesh=meshes[rank],
    )


def new_lanes(layout: Layout) -> dict[tuple[int, int], Lanes | None]:
    """Every pipeline's :class:`~lightning_gpipe.transport.p2p.Lanes` on Gloo, by (replica, tensor-parallel
    rank) (all ranks must call this, in the same order); ``None`` for each on other backends and with one
    stage."""
    keys = [(d, t) for d in range(layout.replicas) for t in range(layout.tensors)]
    if layout.stages < 2 or dist.get_backend() != "gloo":
        return dict.fromkeys(keys)
    lanes: dict[tuple[int, int], Lanes | None] = {}
    for d, t in keys:
        ranks = layout.pipeline_ranks(d, t)
        upward, downward = dist.new_group(ranks), dist.new_group(ranks)
        lanes[d, t] = Lanes(ranks, upward, downward)
    return lanes


_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
_EXIT_HOOK = False
EXIT_WAIT_S = 30.0
"""At exit, how long to wait for background send waits still pending (after a failure), seconds."""


def close_at_exit(holder: Any) -> None:
    """Destroy every process group when this process exits normally, while Python still runs.

    Left to interpreter finalization, a Gloo worker thread that is still releasing the tensors of
    the last collective (the caller's ``wait`` has returned, the worker's clean-up has not) must
    take the GIL to free them; during finalization that ends the thread with a forced unwind and
    the whole process with ``terminate called without an active exception`` (SIGABRT, exit code
    134) after a run that succeeded (pytorch/pytorch#179291 proposes the same hook in
    ``init_process_group``). At exit this destroys the default group and, through
    ``holder.release_groups()`` for every registered holder, drops the subgroup handles it keeps,
    so that every group's worker threads are joined before finalization begins.

    The same holds for a send still waited for in the background (:class:`lightning_gpipe.transport.p2p.P2P`)
    when a rank leaves after a failure: woken during finalization by its peer's receive or closed
    connection, its thread would abort the process. The hook first waits up to :data:`EXIT_WAIT_S`
    seconds for such sends; they end when the peer receives or goes away, which the failure
    protocol (:mod:`lightning_gpipe.transport.failure`) makes prompt.

    Args:
        holder: an object with a ``release_groups()`` method (the strategy); held weakly.
    """
    global _EXIT_HOOK
    _HOLDERS.add(holder)
    if not _EXIT_HOOK:
        atexit.register(_close_process_groups)
        _EXIT_HOOK = True


def _close_process_groups() -> None:
    if not join_sends(EXIT_WAIT_S):
        log.warning(
            f"gpipe: background send waits still wait for a peer after {EXIT_WAIT_S} s at exit; "
            "this process may abort while Python shuts down"
        )
    close_all()


def close_all(collect: bool = True) -> None:
    """Destroy the default process group and every group made from it, and drop the handles the
    registered holders (:func:`close_at_exit`) and this module keep: at exit, and before the ranks
    connect again (:mod:`lightning_gpipe.transport.rendezvous`). ``collect``: run the garbage
    collector, so that groups caught in reference cycles are destroyed now (at exit: before
    finalization); it walks the whole heap, a second or more in a Lightning process."""
    release: list[Callable[[], None]] = [h.release_groups for h in list(_HOLDERS)]
    for fn in release:
        fn()
    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release_connections()
    if collect:
        gc.collect()  # groups caught in reference cycles are destroyed (their threads joined) now
