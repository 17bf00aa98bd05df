"""Point-to-point transport between stages: the message header codec and :class:`P2P`.

Every message is a fixed-size int64 *header* followed by the tensors it describes, so shapes and
dtypes travel with the data on every step (nothing is cached from the first step). A value that is
not a tensor or a tuple of tensors (a dict, nested lists, ``None``, numbers, strings:
:mod:`lightning_gpipe.microbatch`) sends its structure and non-tensor leaves as a last uint8 tensor
of compact JSON (:func:`encode_structure`: a restricted codec, never pickle). Sends are
asynchronous (``isend``) and their waits are deferred to :meth:`P2P.flush` (on CPU a thread waits
for them as they complete and frees their buffers), so a stage computes micro-batch ``i+1`` while
micro-batch ``i`` travels. Receives the stage knows are coming
(:meth:`P2P.expect`: the rest of a phase's micro-batches) are taken in the background, so that
micro-batch ``i+1`` arrives while the stage computes micro-batch ``i``. Transport is
``torch.distributed`` on the default group with global ranks: Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe._compat import unrecorded
from lightning_gpipe.microbatch import CONSTANTS, SLOT, TREE, TUPLE, MicroBatchError, Structure

__all__ = [
    "HEADER_SLOTS",
    "P2P",
    "Meta",
    "decode_header",
    "decode_message",
    "decode_structure",
    "encode_header",
    "encode_message",
    "encode_structure",
    "join_receives",
]

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


def encode_header(
    tensors: Sequence[Tensor], structure: Structure | None, chunks: int, device: torch.device, blob: int = 0
) -> Tensor:
    """Pack ``[chunks, kind, n, (dtype, flags, ndim, *shape) × n]`` into int64 slots.

    ``kind`` is ``structure.kind`` (``None``: a tuple of tensors, none replicated); ``flags`` is
    ``requires_grad | replicated << 1``. A :data:`~lightning_gpipe.microbatch.TREE` message also
    describes its structure's ``blob`` bytes (:func:`encode_message`), as a last uint8 tensor.

    Raises:
        ValueError: a tensor's dtype has no code, or the description does not fit in
            :data:`HEADER_SLOTS` slots.
    """
    if structure is None:
        kind, whole = TUPLE, (False,) * len(tensors)
    else:
        kind, whole = structure.kind, structure.whole
    fields = [chunks, kind, len(tensors) + (kind == TREE)]
    for t, w in zip(tensors, whole):
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [_CODE[t.dtype], int(t.requires_grad) | int(w) << 1, t.dim(), *t.shape]
    if kind == TREE:
        fields += [_CODE[torch.uint8], 0, 1, blob]
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
    """What a message says: the number of micro-batches M, the value's structure and each tensor's
    (shape, dtype, requires_grad).

    ``blob`` is the byte count of a :data:`~lightning_gpipe.microbatch.TREE` structure that follows
    the tensors (0: none); until it is decoded, such a structure holds only ``kind`` and ``whole``.
    """

    chunks: int
    structure: Structure
    specs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]
    blob: int = 0


def decode_header(header: Tensor) -> Meta:
    """Inverse of :func:`encode_header`."""
    h = header.tolist()
    chunks, kind, n = h[0], h[1], h[2]
    specs, whole, k = [], [], 3
    for _ in range(n):
        code, flags, ndim = h[k], h[k + 1], h[k + 2]
        shape = tuple(h[k + 3 : k + 3 + ndim])
        specs.append((shape, _DTYPES[code], bool(flags & 1)))
        whole.append(bool(flags & 2))
        k += 3 + ndim
    blob = specs.pop()[0][0] if kind == TREE else 0
    return Meta(chunks, Structure(kind, tuple(whole[: len(specs)])), tuple(specs), blob)


def encode_message(
    tensors: Sequence[Tensor], structure: Structure | None, chunks: int, device: torch.device
) -> list[Tensor]:
    """What travels for a value: ``[header, *tensors, blob]``, ``blob`` (uint8) only for a
    :data:`~lightning_gpipe.microbatch.TREE`; ``structure=None`` sends a tuple of tensors.

    Raises:
        ValueError: see :func:`encode_header`.
        MicroBatchError: the structure holds a node or a dict key that cannot travel (see
            :func:`encode_structure`).
    """
    payload = [t.detach().contiguous() for t in tensors]
    if structure is None or structure.kind != TREE:
        return [encode_header(tensors, structure, chunks, device), *payload]
    data = encode_structure(structure)
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    return [encode_header(tensors, structure, chunks, device, len(data)), *payload, blob]


def decode_message(meta: Meta, received: list[Tensor]) -> tuple[Meta, list[Tensor]]:
    """The message's meta and tensors once every tensor :func:`decode_header` announced has arrived
    (the blob, last, decoded into the structure)."""
    if not meta.blob:
        return meta, received
    blob = received.pop()
    structure = decode_structure(blob.cpu().numpy().tobytes(), meta.structure.whole)
    return replace(meta, structure=structure), received


def encode_structure(structure: Structure) -> bytes:
    """A :data:`~lightning_gpipe.microbatch.TREE` structure as compact JSON: a restricted codec, no pickle.

    Nodes are ``["t", ...]`` (tuple), ``["l", ...]`` (list), ``["d", [key, value], ...]`` (dict)
    and ``["o", ...]`` (OrderedDict); ``["T"]`` is a tensor's place; leaves and dict keys are
    JSON's own ``null``, ``true``/``false``, numbers (``NaN`` and ``Infinity`` included) and strings.

    Raises:
        MicroBatchError: a node of another type (a namedtuple, a dataclass, a ``ModelOutput``) or a
            dict key that is not a constant; the message names its path.
    """
    return json.dumps(_encode(structure.template(), ""), separators=(",", ":")).encode()


def decode_structure(data: bytes, whole: Sequence[bool]) -> Structure:
    """Inverse of :func:`encode_structure` (``whole``: per tensor, from the header)."""
    return Structure.of_template(_decode(json.loads(data)), whole)


def _encode(node: Any, path: str) -> Any:
    if node is SLOT:
        return ["T"]
    if type(node) in CONSTANTS:
        return node
    if type(node) in (tuple, list):
        return [
            "t" if type(node) is tuple else "l",
            *(_encode(c, f"{path}[{k}]") for k, c in enumerate(node)),
        ]
    if type(node) in (dict, OrderedDict):
        for key in node:
            if type(key) not in CONSTANTS:
                raise MicroBatchError(
                    f"a value between stages has a dict key of type {type(key).__name__} at {path or 'its top'} "
                    f"({key!r}); keys that travel between stages are str, int, float, bool or None"
                )
        items = ([k, _encode(v, f"{path}[{k!r}]")] for k, v in node.items())
        return ["d" if type(node) is dict else "o", *items]
    raise MicroBatchError(
        f"a value between stages holds a {type(node).__name__} at {path or 'its top'}; between stages the "
        "pipeline carries dicts, lists and tuples (of tensors, None, bool, int, float, str): return its "
        "fields as a dict or a tuple"
    )


def _decode(node: Any) -> Any:
    if not isinstance(node, list):
        return node
    tag, *rest = node
    if tag == "T":
        return SLOT
    if tag in ("t", "l"):
        children = [_decode(c) for c in rest]
        return tuple(children) if tag == "t" else children
    if tag in ("d", "o"):
        pairs = [(k, _decode(v)) for k, v in rest]
        return dict(pairs) if tag == "d" else OrderedDict(pairs)
    raise ValueError(f"unknown node {tag!r} in a message's structure")


class P2P:
    """Send and receive tuples of tensors between global ranks, with deferred send waits.

    Receives are posted when :meth:`recv` asks, unless :meth:`expect` announced them: then a
    background thread per source takes the announced messages in order (each one's header, then its
    tensors) while the stage computes, and :meth:`recv` hands them out. The message *count* must
    be exact: a receive left posted would take a message meant for a later phase. The stage
    derives it from its schedule's actions (:func:`lightning_gpipe.schedule.messages`).

    Args:
        device: where received tensors are allocated (the stage's device).
        background: receive announced messages in a background thread, and wait for each send
            in another as it completes, dropping its buffer (default: on CPU devices, i.e. Gloo,
            whose send ``Work.is_completed()`` stays ``False`` until waited for; on CUDA every
            receive is posted when it is needed and :meth:`settle` polls the sends).
    """

    def __init__(self, device: torch.device, background: bool | None = None) -> None:
        self.device = device
        self.background = device.type == "cpu" if background is None else background
        self._pending: list[tuple[dist.Work, object]] = []
        self._inboxes: dict[int, _Inbox] = {}
        self._waiter = _SendWaiter()  # background: waits for the sends posted, in order

    def send(
        self, tensors: Sequence[Tensor], dst: int, *, structure: Structure | None = None, chunks: int = 0
    ) -> None:
        """Post an asynchronous send of ``tensors`` (the value ``structure`` describes; ``None``: a
        tuple of tensors) to ``dst`` (:func:`encode_message`); waits happen in :meth:`flush`.

        The sends open no profiler event (:func:`lightning_gpipe._compat.unrecorded`): a wait deferred
        past the profiler's next step would close it in a freed event list."""
        for t in encode_message(tensors, structure, chunks, self.device):
            with unrecorded():  # the send may complete after the profiler's next cycle began
                work = dist.isend(t, dst)
            assert work is not None
            if self.background:
                self._waiter.put(work, t)
            else:
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
        if meta.blob:
            tensors.append(torch.empty(meta.blob, dtype=torch.uint8, device=self.device))
        works = [dist.irecv(t, src) for t in tensors]
        for w in works:
            _wait(w)
        return decode_message(meta, tensors)

    def flush(self) -> None:
        """Wait for every posted send.

        Raises:
            RuntimeError: (or the transport's own error) a send failed, e.g. its peer went away.
        """
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
        self._waiter.close()

    def settle(self) -> None:
        """Forget the sends that have completed (their buffers may be freed), without waiting.

        With background transport (Gloo) a thread waits for each send as it is posted and drops
        its buffer once the peer has it: a Gloo send's ``Work.is_completed()`` stays ``False``
        until ``wait()`` is called, so polling it would keep every buffer to :meth:`flush`.
        """
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]

    def sends_in_flight(self) -> int:
        """Sends posted whose buffers are still held (not yet known to have completed)."""
        return len(self._pending) + self._waiter.held


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


class _SendWaiter:
    """Waits, in a thread, for the sends :meth:`P2P.send` posts, in order, and drops each buffer
    once its send has completed, so that a stage that sends as it goes (1F1B) frees what it sent
    as the peer takes it rather than at the step's :meth:`P2P.flush`.

    The thread runs while sends are left to wait for (a later :meth:`put` starts another);
    :meth:`close` waits for every send put so far and raises the first send's error, if any (the
    later sends are then not waited for).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: deque[tuple[dist.Work, Tensor]] = deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def held(self) -> int:
        """Sends put whose buffers are still held."""
        with self._lock:
            return len(self._sends)

    def put(self, work: dist.Work, buffer: Tensor) -> None:
        with self._lock:
            self._sends.append((work, buffer))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpipe-send-wait", daemon=True)
                _RECEIVING.add(self._thread)
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._sends:
                        self._thread = None
                        return
                    work = self._sends[0][0]
                if self._error is None:
                    try:
                        work.wait()
                    except BaseException as err:  # noqa: BLE001 - raised by close, in the stage's thread
                        self._error = err
                with self._lock:
                    self._sends.popleft()  # the buffer goes now: its send has completed
        finally:
            _RECEIVING.discard(threading.current_thread())

    def close(self) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


def _wait(work: dist.Work | None) -> None:
    assert work is not None
    work.wait()


_RECEIVING: set[threading.Thread] = set()  # background receive threads still running


def join_receives(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds, all together, for background receives (and send waits) still running.

    Returns:
        ``True`` when none is left running.
    """
    deadline = time.monotonic() + timeout
    for thread in list(_RECEIVING):
        thread.join(max(deadline - time.monotonic(), 0.0))
    return not any(t.is_alive() for t in _RECEIVING)
