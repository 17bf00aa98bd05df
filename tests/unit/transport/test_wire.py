"""The wire format: the header codec, the restricted structure codec and the CPU payload."""

import math
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_gpipe.engine.microbatch import TENSOR, TUPLE, MicroBatchError, Structure, flatten, unflatten
from lightning_gpipe.transport import wire
from lightning_gpipe.transport.wire import (
    FIRST_ROOM,
    HEADER_SLOTS,
    decode_header,
    decode_message,
    decode_structure,
    encode_header,
    encode_message,
    encode_structure,
    pack,
    payload_bytes,
    unpack,
)


@pytest.mark.parametrize("kind", [TENSOR, TUPLE])
def test_header_round_trips_shapes_dtypes_gradients_and_chunks(kind):
    tensors = [
        torch.zeros(3, 4, requires_grad=True),
        torch.arange(5),
        torch.ones(2, 1, 7, dtype=torch.bfloat16),
        torch.zeros((), dtype=torch.bool),
        torch.zeros(0, 3, dtype=torch.complex64),
    ]
    whole = (False, True, False, True, False)
    header = encode_header(tensors, Structure(kind, whole), 8, torch.device("cpu"))
    assert header.shape == (HEADER_SLOTS,) and header.dtype == torch.int64
    meta = decode_header(header)
    assert meta.chunks == 8 and meta.structure == Structure(kind, whole) and meta.blob == 0
    assert meta.specs == tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


def test_header_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match="cannot send a tensor of dtype torch.uint16"):
        encode_header([torch.zeros(2, dtype=torch.uint16)], None, 1, torch.device("cpu"))
    many = [torch.zeros(1, 1, 1, 1, 1, 1) for _ in range(7)]  # 3 + 7 * (3 + 6) = 66 > 64 slots
    with pytest.raises(ValueError, match="7 tensors with 42 dims in all, more than a 64-slot header"):
        encode_header(many, None, 1, torch.device("cpu"))
    assert decode_header(encode_header([], None, 3, torch.device("cpu"))).specs == ()


def test_a_pytree_message_round_trips_every_leaf_type_and_node():
    value = {
        "h": torch.randn(3, 4, requires_grad=True),
        "ids": torch.arange(3),
        "mask": torch.tensor([True, False, True]),
        "t": torch.tensor(2.5, dtype=torch.float64),
        "rope": (torch.randn(5, 4), [torch.randn(5, 4), ()]),
        7: {"nested": OrderedDict(b=1, a=[None, "é✓"]), "empty": {}, "list": []},
        None: -(2**62),
        "floats": (0.5, -0.0, float("inf"), 1e-300),
        "strings": ("", "T", '["T"]', "line\nbreak"),
        "flags": (True, False, 1, 0),
        "note": None,
    }
    tensors, structure = flatten(value, "value", keep=[value["rope"][0]])
    header, *payload = encode_message(tensors, structure, 4, torch.device("cpu"))
    assert payload[-1].dtype == torch.uint8 and len(payload) == len(tensors) + 1
    meta, received = decode_message(decode_header(header), payload)
    assert (
        meta.chunks == 4
        and meta.structure == structure
        and meta.structure.whole == (False,) * 3 + (True, True, False)
    )
    assert meta.specs == tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
    back = unflatten(meta.structure, received)
    assert list(back) == list(value) and type(back[7]["nested"]) is OrderedDict
    assert back["flags"] == (True, False, 1, 0) and [type(f) for f in back["flags"]] == [bool, bool, int, int]
    assert back["floats"] == (0.5, -0.0, float("inf"), 1e-300) and math.copysign(1, back["floats"][1]) == -1
    assert back["strings"] == value["strings"] and back[None] == -(2**62) and back[7] == value[7]
    assert torch.equal(back["rope"][1][0], value["rope"][1][0]) and back["rope"][1][1] == ()
    nan = flatten({"x": torch.zeros(1), "nan": float("nan")}, "value")[1]
    assert math.isnan(decode_structure(encode_structure(nan), nan.whole).leaves[1])


def test_a_tensor_message_is_the_header_and_the_tensor_as_before():
    x = torch.randn(4, 3, requires_grad=True)
    header, *payload = encode_message((x,), Structure(TENSOR, (False,)), 2, torch.device("cpu"))
    assert len(payload) == 1 and torch.equal(payload[0], x)
    # [chunks, kind (tensor), n, float32's code, requires_grad, ndim, *shape]: the slots of a tensor's header
    assert header[:8].tolist() == [2, 0, 1, 0, 1, 2, 4, 3] and not header[8:].any()


def test_nodes_and_keys_that_cannot_travel_are_refused_naming_their_path():
    point = namedtuple("Point", "x y")
    tensors, structure = flatten({"a": [point(torch.zeros(2), 1)]}, "value")
    with pytest.raises(
        MicroBatchError, match=r"holds a Point at \['a'\]\[0\].*return its fields as a dict or a tuple"
    ):
        encode_message(tensors, structure, 1, torch.device("cpu"))
    tensors, structure = flatten({("a", 1): torch.zeros(2)}, "value")
    with pytest.raises(MicroBatchError, match=r"dict key of type tuple at its top \(\('a', 1\)\)"):
        encode_message(tensors, structure, 1, torch.device("cpu"))


def _packed_round_trip(tensors, structure=None, room=FIRST_ROOM):
    """The message's payload as packed for ``room`` and as the receiver reads it: ``(payload,
    overflow, total, meta, buffer)``, ``buffer`` the receiver's room holding what arrived."""
    header, *sent = encode_message(tensors, structure, 3, torch.device("cpu"))
    payload, overflow, total = pack(sent, room)
    meta = decode_header(header.clone())
    assert payload_bytes(meta) == total  # the receiver's own count of the payload
    buffer = torch.zeros(room, dtype=torch.uint8)  # the receiver's room, larger than the message
    raw = payload.reshape(-1).view(torch.uint8)
    buffer[: raw.numel()] = raw
    return payload, overflow, total, meta, buffer


def test_a_payload_within_the_room_is_one_aligned_buffer_every_dtype_and_shape_round_trips():
    tensors = [
        torch.randn(3, 5),
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        torch.randn(0, 4),  # empty
        torch.randn(7).half(),  # 14 bytes: the next tensor starts padded
        torch.randn(2, 3).bfloat16(),
        torch.arange(5, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex128),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    payload, overflow, total, meta, buffer = _packed_round_trip(tensors)
    assert (
        not overflow and total == payload.numel() == 64 + 16 + 0 + 16 + 16 + 32 + 16 + 48 + 96
    )  # each padded to 16
    for received in unpack(buffer, meta), unpack(buffer, meta, copy=True):
        for a, b in zip(received, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            assert a.untyped_storage().data_ptr() != buffer.data_ptr()  # copies: the dtypes differ


def test_a_payload_of_one_dtype_arrives_as_views_into_its_buffer_unless_copied():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.tensor(1.5)]
    _, _, _, meta, buffer = _packed_round_trip(tensors)
    views, copies = unpack(buffer, meta), unpack(buffer, meta, copy=True)
    for a, c, b in zip(views, copies, tensors):
        assert torch.equal(a, b) and torch.equal(c, b)
        assert a.untyped_storage().data_ptr() == buffer.data_ptr() != c.untyped_storage().data_ptr()
        assert a.data_ptr() % 16 == 0  # 7 floats are padded to 32 bytes: the next tensor is aligned


@pytest.mark.parametrize(
    "x", [torch.randn(6, 5), torch.arange(12, dtype=torch.int64).reshape(3, 4)[1:], torch.randn(4, 3).t()]
)
def test_one_tensor_travels_as_it_is_without_a_copy_when_it_is_contiguous(x):
    """The payload of a one-tensor message is that tensor's own memory (a stage's activation or
    gradient is not copied to be sent); a non-contiguous one is made contiguous first."""
    payload, overflow, total, meta, buffer = _packed_round_trip([x])
    assert (
        not overflow and payload.dtype == torch.uint8 and total == -(-x.numel() * x.element_size() // 16) * 16
    )
    if x.is_contiguous():
        assert payload.data_ptr() == x.data_ptr() and payload.numel() == x.numel() * x.element_size()
    (received,) = unpack(buffer, meta)
    assert received.dtype == x.dtype and torch.equal(received, x)


def test_a_payload_over_the_room_sends_a_placeholder_then_the_tensors():
    x, y = torch.randn(150, 128), torch.arange(5)
    payload, overflow, total, meta, _ = _packed_round_trip([x, y], room=FIRST_ROOM)
    assert total > FIRST_ROOM and payload.numel() == 16 and len(overflow) == 2
    assert torch.equal(overflow[0], x) and torch.equal(overflow[1], y)
    assert [s for s, _, _ in meta.specs] == [(150, 128), (5,)]
    again, overflow_again, total_again, _, _ = _packed_round_trip([x, y], room=total)  # the grown room
    assert not overflow_again and total_again == total == again.numel()
    (one,) = _packed_round_trip([x], room=FIRST_ROOM)[1]  # one tensor over the room: the same
    assert one is not None and torch.equal(one, x)


def test_a_message_of_empty_tensors_has_an_empty_payload_and_no_overflow():
    tensors = [torch.randn(0, 4), torch.zeros(0, dtype=torch.int64)]
    payload, overflow, total, meta, buffer = _packed_round_trip(tensors)
    assert total == 0 and not overflow and payload.numel() == 16  # the placeholder takes the posted receive
    assert [tuple(t.shape) for t in unpack(buffer, meta)] == [(0, 4), (0,)]


def test_a_pytree_payload_carries_its_structure():
    value = {"h": torch.randn(2, 3), "mask": None, "n": 4}
    tensors, structure = flatten(value, "value")
    _, overflow, _, meta, buffer = _packed_round_trip(tensors, structure)
    meta, received = decode_message(meta, unpack(buffer, meta))
    assert not overflow
    out = unflatten(meta.structure, received)
    assert out["mask"] is None and out["n"] == 4 and torch.equal(out["h"], value["h"])


def test_tensors_of_one_payload_are_not_views_each_has_its_own_version_counter():
    h, mask = torch.randn(4, 3), torch.ones(4, 3)
    _, _, _, meta, buffer = _packed_round_trip([h, mask])
    rh, rmask = unpack(buffer, meta)
    assert rh._base is None and rmask._base is None
    assert rh.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # no copy
    w = torch.randn(3, 2, requires_grad=True)
    rh.requires_grad_(True)
    out = torch.sigmoid(rh @ w)  # saves rh and its own output
    rmask.mul_(2)  # an in-place change of another tensor of the message
    out.sum().backward()  # rh's saved version is untouched
    assert torch.equal(rmask, 2 * mask) and torch.equal(rh.detach(), h)


def test_conjugate_and_negative_views_travel_as_their_values():
    z = torch.randn(3, dtype=torch.complex64)
    tensors = [z.conj(), torch.randn(3, dtype=torch.complex64).conj().imag]  # conj bit, neg bit
    expected = [t.resolve_conj().resolve_neg() for t in tensors]
    _, _, _, meta, buffer = _packed_round_trip(tensors)
    for a, b in zip(unpack(buffer, meta), expected):
        assert torch.equal(a, b)


def test_a_repeated_description_is_encoded_and_decoded_once_and_a_new_one_anew(monkeypatch):
    """Every micro-batch sends the same description: its header tensor and its decoded meta are kept
    (shared, never written to); another shape, dtype, gradient flag, chunk count or structure is
    described anew, also after the kept ones were dropped for want of room."""
    monkeypatch.setattr(wire, "_KEPT", 4)
    cpu = torch.device("cpu")
    x = torch.randn(4, 3, requires_grad=True)
    first = encode_header([x], None, 8, cpu)
    assert encode_header([torch.zeros(4, 3, requires_grad=True)], None, 8, cpu) is first
    variants = [
        ([torch.randn(5, 3, requires_grad=True)], None, 8),
        ([torch.randn(4, 3)], None, 8),
        ([x.detach().double().requires_grad_()], None, 8),
        ([x], None, 3),
        ([x], Structure(TENSOR, (True,)), 8),
        ([x, torch.arange(2)], None, 8),
    ]
    for _ in range(2):  # the second time round, past the room kept: from scratch again
        for tensors, structure, chunks in [([x], None, 8), *variants]:
            header = encode_header(tensors, structure, chunks, cpu)
            meta = decode_header(header.clone())
            assert decode_header(header.clone()) is meta
            assert meta.chunks == chunks and meta.structure.whole == (
                structure.whole if structure is not None else (False,) * len(tensors)
            )
            assert meta.specs == tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
    kept = first.clone()
    pack([x.detach()], FIRST_ROOM)
    assert torch.equal(first, kept)  # packing left the shared header as it was
    assert decode_header(first).specs == (((4, 3), torch.float32, True),)
