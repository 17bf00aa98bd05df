"""What travels between stages: the message header and the structure codec.

Every message is a fixed-size int64 *header* (:func:`encode_header`) followed by the tensors it
describes, so shapes and dtypes travel with the data on every step (nothing is cached from the
first step). A value that is not a tensor or a tuple of tensors (a dict, nested lists, ``None``,
numbers, strings: :mod:`lightning_gpipe.engine.microbatch`) sends its structure and non-tensor leaves as
a last uint8 tensor of compact JSON (:func:`encode_structure`: a restricted codec, never pickle).

The transport that sends and receives these is :mod:`lightning_gpipe.transport.p2p`.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.errors import MicroBatchError
from lightning_gpipe.transport.structure import CONSTANTS, SLOT, TREE, TUPLE, Structure

__all__ = [
    "HEADER_SLOTS",
    "Meta",
    "can_travel",
    "decode_header",
    "decode_header_bytes",
    "decode_message",
    "decode_structure",
    "encode_header",
    "encode_message",
    "encode_structure",
    "header_slots",
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


def can_travel(t: Tensor) -> bool:
    """Whether tensor ``t`` can travel between stages: a dense tensor of a dtype the header knows."""
    return t.dtype in _CODE and t.layout == torch.strided


def header_slots(t: Tensor) -> int:
    """The header slots tensor ``t`` takes in a message (:func:`encode_header`)."""
    return 3 + t.dim()


def encode_header(
    tensors: Sequence[Tensor], structure: Structure | None, chunks: int, device: torch.device, blob: int = 0
) -> Tensor:
    """Pack ``[chunks, kind, n, (dtype, flags, ndim, *shape) × n]`` into int64 slots.

    ``kind`` is ``structure.kind`` (``None``: a tuple of tensors, none replicated); ``flags`` is
    ``requires_grad | replicated << 1``. A :data:`~lightning_gpipe.engine.microbatch.TREE` message also
    describes its structure's ``blob`` bytes (:func:`encode_message`), as a last uint8 tensor.

    A step sends the same description again and again (every micro-batch's activation, every
    gradient), so each header is built once per description and kept (:data:`_HEADERS`): the
    tensor returned is shared and must not be written to.

    Raises:
        ValueError: a tensor's dtype has no code, or the description does not fit in
            :data:`HEADER_SLOTS` slots.
    """
    if structure is None:
        kind, whole = TUPLE, (False,) * len(tensors)
    else:
        kind, whole = structure.kind, structure.whole
    key = (chunks, kind, blob, whole, device, *[(t.dtype, t.requires_grad, t.shape) for t in tensors])
    header = _HEADERS.get(key)
    if header is None:
        header = _build_header(tensors, kind, whole, chunks, device, blob)
        if len(_HEADERS) >= _KEPT:  # shapes that vary without end (e.g. sequence lengths) keep no more
            _HEADERS.clear()
        _HEADERS[key] = header
    return header


def _build_header(
    tensors: Sequence[Tensor], kind: int, whole: Sequence[bool], chunks: int, device: torch.device, blob: int
) -> Tensor:
    fields = [chunks, kind, len(tensors) + (kind == TREE)]
    for t, w in zip(tensors, whole):
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [_CODE[t.dtype], int(t.requires_grad) | int(w) << 1, t.dim(), *t.shape]
    if kind == TREE:
        fields += [_CODE[torch.uint8], 0, 1, blob]
    if len(fields) > HEADER_SLOTS:
        raise ValueError(
            f"a stage boundary carries {len(tensors)} tensors with {sum(t.dim() for t in tensors)} dims in "
            f"all, more than a {HEADER_SLOTS}-slot header can describe; pass fewer tensors between stages"
        )
    header = torch.tensor(fields + [0] * (HEADER_SLOTS - len(fields)), dtype=torch.int64)
    return header if device.type == "cpu" else header.to(device)


_KEPT = 256
"""Descriptions whose header (:data:`_HEADERS`) and decoded meta (:data:`_METAS`) are kept."""
_HEADERS: dict[tuple[Any, ...], Tensor] = {}
_METAS: dict[bytes, Meta] = {}


@dataclass(frozen=True)
class Meta:
    """What a message says: the number of micro-batches M, the value's structure and each tensor's
    (shape, dtype, requires_grad).

    ``blob`` is the byte count of a :data:`~lightning_gpipe.engine.microbatch.TREE` structure that follows
    the tensors (0: none); until it is decoded, such a structure holds only ``kind`` and ``whole``.
    """

    chunks: int
    structure: Structure
    specs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]
    blob: int = 0


def decode_header(header: Tensor) -> Meta:
    """Inverse of :func:`encode_header` (kept per header, as the headers are: :data:`_METAS`)."""
    return decode_header_bytes(header.cpu().numpy().tobytes())


def decode_header_bytes(raw: bytes) -> Meta:
    """The :class:`Meta` of a header's bytes (native int64 slots), decoded once per header."""
    meta = _METAS.get(raw)
    if meta is None:
        meta = _decode_slots(struct.unpack(f"={HEADER_SLOTS}q", raw))
        if len(_METAS) >= _KEPT:
            _METAS.clear()
        _METAS[raw] = meta
    return meta


def _decode_slots(h: Sequence[int]) -> Meta:
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
    :data:`~lightning_gpipe.engine.microbatch.TREE`; ``structure=None`` sends a tuple of tensors.

    Raises:
        ValueError: see :func:`encode_header`.
        MicroBatchError: the structure holds a node or a dict key that cannot travel (see
            :func:`encode_structure`).
    """
    payload = [t.detach().resolve_conj().resolve_neg().contiguous() for t in tensors]
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
    """A :data:`~lightning_gpipe.engine.microbatch.TREE` structure as compact JSON: a restricted
    codec, no pickle.

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
                    f"a value between stages has a dict key of type {type(key).__name__} at "
                    f"{path or 'its top'} ({key!r}); keys that travel between stages are str, int, float, "
                    "bool or None"
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
