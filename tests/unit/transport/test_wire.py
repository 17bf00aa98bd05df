"""The wire format: the header codec, the restricted structure codec and the CPU payload."""

import math
from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_gpipe.engine.microbatch import TENSOR, TUPLE, MicroBatchError, Structure, flatten, unflatten
from lightning_gpipe.transport.wire import (
    HEADER_SLOTS,
    decode_header,
    decode_message,
    decode_structure,
    encode_header,
    encode_message,
    encode_structure,
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
