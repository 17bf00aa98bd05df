"""Point-to-point transport between stages: the message header codec and :class:`P2P`.

Every message is a fixed-size int64 *header* followed by the tensors it describes, so shapes and
dtypes travel with the data on every step (nothing is cached from the first step). Sends are
asynchronous (``isend``) and their waits are deferred to :meth:`P2P.flush`, so a stage computes
micro-batch ``i+1`` while micro-batch ``i`` travels. Receives the stage knows are coming
(:meth:`P2P.expect`: the rest of a phase's micro-batches) are taken in the background, so that
micro-batch ``i+1`` arrives while the stage computes micro-batch ``i``. Transport is
``torch.distributed`` on the default group with global ranks: Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["HEADER_SLOTS", "P2P", "Meta", "decode_header", "encode_header", "join_receives"]

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


def encode_header(tensors: Sequence[Tensor], is_tuple: bool, chunks: int, device: torch.device) -> Tensor:
    """Pack ``[chunks, is_tuple, n, (dtype, requires_grad, ndim, *shape) × n]`` into int64 slots.

    Raises:
        ValueError: the description does not fit in :data:`HEADER_SLOTS` slots.
    """
    fields = [chunks, int(is_tuple), len(tensors)]
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
    """What a header says: the number of micro-batches M, tuple-ness and each tensor's (shape, dtype, requires_grad)."""

    chunks: int
    is_tuple: bool
    specs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


def decode_header(header: Tensor) -> Meta:
    h = header.tolist()
    chunks, is_tuple, n = h[0], bool(h[1]), h[2]
    specs, k = [], 3
    for _ in range(n):
        code, rg, ndim = h[k], bool(h[k + 1]), h[k + 2]
        shape = tuple(h[k + 3 : k + 3 + ndim])
        specs.append((shape, _DTYPES[code], rg))
        k += 3 + ndim
    return Meta(chunks, is_tuple, tuple(specs))


class P2P:
    """Send and receive tuples of tensors between global ranks, with deferred send waits.

    Receives are posted when :meth:`recv` asks, unless :meth:`expect` announced them: then a
    background thread per source takes the announced messages in order (each one's header, then its
    tensors) while the stage computes, and :meth:`recv` hands them out. The message *count* must
    be exact: a receive left posted would take a message meant for a later phase. The stage
    derives it from its schedule's actions (:func:`lightning_gpipe.schedule.messages`).

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

    def send(self, tensors: Sequence[Tensor], dst: int, *, is_tuple: bool = True, chunks: int = 0) -> None:
        """Post an asynchronous send of a header and ``tensors`` to ``dst``; waits happen in :meth:`flush`."""
        header = encode_header(tensors, is_tuple, chunks, self.device)
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

    def settle(self) -> None:
        """Forget the sends that have completed (their buffers may be freed), without waiting."""
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]


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


_RECEIVING: set[threading.Thread] = set()  # background receive threads still running


def join_receives(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds, all together, for background receives still running.

    Returns:
        ``True`` when none is left running.
    """
    deadline = time.monotonic() + timeout
    for thread in list(_RECEIVING):
        thread.join(max(deadline - time.monotonic(), 0.0))
    return not any(t.is_alive() for t in _RECEIVING)
