"""Point-to-point transport between stages, and the rank layout of pipeline × data parallelism.

Every message is a fixed-size int64 *header* followed by the tensors it describes, so shapes and
dtypes travel with the data on every step (nothing is cached from the first step). Sends are
asynchronous (``isend``) and their waits are deferred to :meth:`P2P.flush`, so a stage computes
micro-batch ``i+1`` while micro-batch ``i`` travels. Receives the stage knows are coming
(:meth:`P2P.expect`: the rest of a phase's micro-batches) are taken in the background, so that
micro-batch ``i+1`` arrives while the stage computes micro-batch ``i``. Transport is
``torch.distributed`` on the default group with global ranks: Gloo on CPU, NCCL on CUDA.

Rank layout (W = P × D processes, P stages, D data-parallel replicas): replica ``d`` holds global
ranks ``d·P … d·P+P-1`` and stage ``s`` of it sits on rank ``d·P + (P-1-s)``. The *last* stage is
on each pipeline's lowest rank, so global rank 0 holds the real loss and metrics, and Lightning's
rank-zero logging, progress bar and checkpoint decisions see true values.
"""

from __future__ import annotations

import atexit
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

HEADER_SLOTS = 64
_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dt: k for k, dt in enumerate(_DTYPES)}


@dataclass(frozen=True)
class Layout:
    """Where each (replica, stage) runs: ``rank = replica·P + (P-1-stage)``.

    Args:
        world_size: W, all processes.
        pipeline_parallel_size: P, stages per pipeline; ``W % P == 0``.
    """

    world_size: int
    pipeline_parallel_size: int

    def __post_init__(self) -> None:
        p, w = self.pipeline_parallel_size, self.world_size
        if p < 1 or w % p:
            raise ValueError(
                f"the world size must be a multiple of pipeline_parallel_size (world size: {w}, "
                f"pipeline_parallel_size: {p}); set devices × num_nodes to a multiple of it"
            )

    @property
    def stages(self) -> int:
        return self.pipeline_parallel_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + (self.stages - 1 - stage)

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 - rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def data_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage`` in every replica (its data-parallel group)."""
        return [self.rank(d, stage) for d in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of ``replica``'s stages, in stage order."""
        return [self.rank(replica, s) for s in range(self.stages)]


def encode_header(tensors: Sequence[Tensor], is_tuple: bool, count: int, device: torch.device) -> Tensor:
    """Pack ``[count, is_tuple, n, (dtype, requires_grad, ndim, *shape) × n]`` into int64 slots.

    Raises:
        ValueError: the description does not fit in :data:`HEADER_SLOTS` slots.
    """
    fields = [count, int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    if len(fields) > HEADER_SLOTS:
        raise ValueError(
            f"a stage boundary carries {len(tensors)} tensors with {sum(t.dim() for t in tensors)} dims in all, "
            f"more than a {HEADER_SLOTS}-slot header can describe; pass fewer tensors between stages"
        )
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header.to(device)


@dataclass(frozen=True)
class Meta:
    """What a header says: micro-batch count, tuple-ness and each tensor's (shape, dtype, requires_grad)."""

    count: int
    is_tuple: bool
    specs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


def decode_header(header: Tensor) -> Meta:
    h = header.tolist()
    count, is_tuple, n = h[0], bool(h[1]), h[2]
    specs, k = [], 3
    for _ in range(n):
        code, rg, ndim = h[k], bool(h[k + 1]), h[k + 2]
        shape = tuple(h[k + 3 : k + 3 + ndim])
        specs.append((shape, _DTYPES[code], rg))
        k += 3 + ndim
    return Meta(count, is_tuple, tuple(specs))


class P2P:
    """Send and receive tuples of tensors between global ranks, with deferred send waits.

    Receives are posted when :meth:`recv` asks, unless :meth:`expect` announced them: then a
    background thread per source takes the announced messages in order (each one's header, then its
    tensors) while the stage computes, and :meth:`recv` hands them out. The message *count* must
    be exact: a receive left posted would take a message meant for a later phase.

    Args:
        device: where received tensors are allocated (the stage's device).
        background: receive announced messages in a background thread (default: on CPU devices,
            i.e. Gloo; on CUDA every receive is posted when it is needed).
    """

    def __init__(self, device: torch.device, background: bool | None = None) -> None:
        self.device = device
        self.background = device.type == "cpu" if background is None else background
        self._pending: list[tuple[dist.Work, object]] = []
        self._inboxes: dict[int, _Inbox] = {}

    def send(self, tensors: Sequence[Tensor], dst: int, *, is_tuple: bool = True, count: int = 0) -> None:
        """Post an asynchronous send of a header and ``tensors`` to ``dst``; waits happen in :meth:`flush`."""
        header = encode_header(tensors, is_tuple, count, self.device)
        payload = [header] + [t.detach().contiguous() for t in tensors]
        for t in payload:
            work = dist.isend(t, dst)
            assert work is not None
            self._pending.append((work, t))  # keep the buffer alive until the send completes

    def expect(self, src: int, messages: int) -> None:
        """Announce that the next ``messages`` receives from ``src`` follow in this phase; take them early.

        Raises:
            RuntimeError: messages announced earlier from ``src`` are not all taken yet.
        """
        if messages <= 0 or not self.background:
            return
        if src in self._inboxes:
            raise RuntimeError(f"messages announced from rank {src} are still to be received")
        self._inboxes[src] = _Inbox(self, src, messages)

    def recv(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Receive one message from ``src``: its header, then its tensors (allocated from the header)."""
        inbox = self._inboxes.get(src)
        if inbox is None:
            return self.receive_now(src)
        try:
            return inbox.take()
        finally:
            if inbox.left == 0:
                del self._inboxes[src]
                inbox.thread.join()

    def receive_now(self, src: int) -> tuple[Meta, list[Tensor]]:
        """Post the receives of one message from ``src`` and wait for them (in the calling thread)."""
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        _wait(dist.irecv(header, src))
        meta = decode_header(header)
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype, _ in meta.specs]
        works = [dist.irecv(t, src) for t in tensors]
        for w in works:
            _wait(w)
        return meta, tensors

    def flush(self) -> None:
        """Wait for every posted send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


class _Inbox:
    """A thread that receives ``messages`` messages from ``src`` in order, for :meth:`P2P.recv` to take.

    A receive that fails (a peer went away, the group was destroyed after a failure elsewhere)
    is handed to the stage as its exception, and the thread ends.
    """

    def __init__(self, p2p: P2P, src: int, messages: int) -> None:
        self.left = messages
        self._box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, args=(p2p, src, messages), name=f"gpipe-recv-from-{src}", daemon=True
        )
        _RECEIVING.add(self.thread)
        self.thread.start()

    def _run(self, p2p: P2P, src: int, messages: int) -> None:
        try:
            for _ in range(messages):
                try:
                    self._box.put(p2p.receive_now(src))
                except BaseException as err:  # noqa: BLE001 - handed to the stage, which raises it
                    self._box.put(err)
                    return
        finally:
            _RECEIVING.discard(threading.current_thread())

    def take(self) -> tuple[Meta, list[Tensor]]:
        item = self._box.get()
        self.left -= 1
        if isinstance(item, BaseException):
            self.left = 0
            raise item
        return item


def _wait(work: dist.Work | None) -> None:
    assert work is not None
    work.wait()


@dataclass
class Groups:
    """The process groups a rank uses besides point-to-point.

    Attributes:
        pipeline: this rank's pipeline (all stages of its replica); global-norm clipping, metric sharing.
        data: this rank's stage in every replica; gradient all-reduce.
        last_stage_data: the last stage in every replica (``None`` on other ranks' behalf is
            never needed: it is a group handle every rank holds); ``sync_dist`` logging, torchmetrics.
    """

    pipeline: Any
    data: Any
    last_stage_data: Any


_GROUPS: dict[tuple[int, int, int], tuple[list[Any], list[Any]]] = {}


def new_groups(layout: Layout, rank: int) -> Groups:
    """Create every pipeline and data-parallel group (all ranks must call this, in the same order).

    Groups are made once per process group and layout, so repeated ``fit``/``validate`` calls in
    one job reuse them.
    """
    key = (id(dist.group.WORLD), layout.world_size, layout.stages)
    if key not in _GROUPS:
        pipelines = [dist.new_group(layout.pipeline_ranks(d)) for d in range(layout.replicas)]
        datas = [dist.new_group(layout.data_ranks(s)) for s in range(layout.stages)]
        _GROUPS[key] = (pipelines, datas)
    pipelines, datas = _GROUPS[key]
    return Groups(
        pipeline=pipelines[layout.replica_of(rank)],
        data=datas[layout.stage_of(rank)],
        last_stage_data=datas[layout.stages - 1],
    )


_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
_EXIT_HOOK = False
_RECEIVING: set[threading.Thread] = set()  # background receive threads still running
EXIT_WAIT_S = 30.0
"""At exit, how long to wait for background receives still pending (after a failure), seconds."""


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

    The same holds for a background receive (:meth:`P2P.expect`) still waiting when a rank leaves
    after a failure: woken during finalization by its peer's message or closed connection, it
    would abort the process. The hook first waits up to :data:`EXIT_WAIT_S` seconds for such
    receives; they end when the peer sends or goes away, which the failure protocol
    (:mod:`lightning_gpipe.failure`) makes prompt.

    Args:
        holder: an object with a ``release_groups()`` method (the strategy); held weakly.
    """
    global _EXIT_HOOK
    _HOLDERS.add(holder)
    if not _EXIT_HOOK:
        atexit.register(_close_process_groups)
        _EXIT_HOOK = True


def _close_process_groups() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_RECEIVING):
        thread.join(max(deadline - time.monotonic(), 0.0))
    if any(t.is_alive() for t in _RECEIVING):
        log.warning(
            f"gpipe: background receives still wait for a peer after {EXIT_WAIT_S} s at exit; "
            "this process may abort while Python shuts down"
        )
    release: list[Callable[[], None]] = [h.release_groups for h in list(_HOLDERS)]
    for fn in release:
        fn()
    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups caught in reference cycles are destroyed (their threads joined) now
