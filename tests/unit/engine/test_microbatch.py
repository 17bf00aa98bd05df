import pytest
import torch

from lightning_gpipe.engine.microbatch import (
    TENSOR,
    TREE,
    TUPLE,
    MicroBatchError,
    as_tensors,
    flatten,
    gather,
    join,
    no_chunk,
    scatter,
    sizes,
    split,
    unflatten,
)


@pytest.mark.parametrize(
    "n,m,sizes",
    [(10, 3, [4, 3, 3]), (10, 4, [3, 3, 2, 2]), (10, 1, [10]), (3, 8, [1, 1, 1]), (8, 4, [2, 2, 2, 2])],
)
def test_split_sizes_near_equal_never_empty(n, m, sizes):
    x = torch.arange(n * 2).reshape(n, 2)
    parts = split((x,), m)
    assert [p[0].shape[0] for p in parts] == sizes
    assert torch.equal(join(parts)[0], x)


def test_split_tuple_keeps_dtypes_and_alignment():
    x, ids, mask = torch.randn(5, 3), torch.arange(5), torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)
    parts = split((x, ids, mask), 2)
    assert [p[1].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert parts[1][2].dtype == torch.bool
    x2, ids2, mask2 = join(parts)
    assert torch.equal(x2, x) and torch.equal(ids2, ids) and torch.equal(mask2, mask)


def test_bad_batches_raise_clear_errors():
    with pytest.raises(MicroBatchError, match="got dict"):
        as_tensors({"x": torch.zeros(1)})
    with pytest.raises(MicroBatchError, match="Tensor, int"):
        as_tensors((torch.zeros(1), 3))
    with pytest.raises(MicroBatchError, match="dim 0 sizes: \\[4, 3\\]"):
        split((torch.zeros(4), torch.zeros(3)), 2)
    with pytest.raises(MicroBatchError, match="0-dimensional"):
        split((torch.tensor(1.0),), 2)
    with pytest.raises(MicroBatchError, match="batch size is 0"):
        split((torch.zeros(0, 3),), 2)
    with pytest.raises(ValueError, match=r"chunks must be an integer >= 1 \(chunks: 0\)"):
        split((torch.zeros(4),), 0)


@pytest.mark.parametrize(("n", "chunks"), [(10, 4), (2, 4), (8, 8), (7, 3), (1, 1), (9, 2)])
def test_split_sizes_follow_the_one_rule(n, chunks):
    parts = split([torch.zeros(n, 2)], chunks)
    assert [p[0].shape[0] for p in parts] == sizes(n, chunks)
    assert sizes(10, 4) == [3, 3, 2, 2] and sizes(2, 4) == [1, 1]


def test_min_size_caps_the_micro_batch_count():
    """``min_size=2`` (a model with BatchNorm): at most N // 2 micro-batches, at least one."""
    assert sizes(12, 8, min_size=2) == [2] * 6 and sizes(13, 4, min_size=2) == [4, 3, 3, 3]
    assert sizes(3, 4, min_size=2) == [3] and sizes(1, 4, min_size=2) == [1]
    parts, _ = scatter(torch.zeros(12, 2), 8, min_size=2)
    assert [p[0].shape[0] for p in parts] == [2] * 6


def test_sizes_reject_bad_counts():
    with pytest.raises(TypeError, match="chunks must be an integer >= 1"):
        sizes(4, 2.0)
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1 \(batch_size: 0\)"):
        sizes(0, 2)


# -- any pytree between layers ---------------------------------------------------------------------


def _tree(n=10, t=7, d=8):
    return {
        "h": torch.randn(n, t, d),
        "mask": torch.rand(n, t) > 0.3,
        "causal": torch.ones(t, t, dtype=torch.bool).tril(),
        "rope": (torch.randn(t, d), torch.randn(t, d)),
        "step": torch.tensor(3),
        "ids": [torch.arange(n), "tag"],
        "scale": 0.5,
        "note": None,
        "flag": True,
    }


def test_a_pytree_splits_what_has_the_batch_dimension_and_replicates_the_rest():
    value = _tree()
    micro_batches, structure = scatter(value, 4)
    assert structure.kind == TREE
    # tensors in flatten order: h, mask, causal, cos, sin, step, ids[0]
    assert structure.whole == (False, False, True, True, True, True, False)
    assert [mb[0].shape[0] for mb in micro_batches] == sizes(10, 4)
    parts = [unflatten(structure, mb) for mb in micro_batches]
    assert list(parts[0]) == list(value)  # keys in the user's order
    for part in parts:
        assert part["causal"] is value["causal"] and part["rope"][0] is value["rope"][0]  # no copy
        assert part["step"] is value["step"] and part["ids"][1] == "tag" and part["note"] is None
        assert part["scale"] == 0.5 and part["flag"] is True
    assert torch.equal(parts[2]["ids"][0], torch.tensor([6, 7]))
    # each stage's output: what passes on unchanged stays replicated, new tensors are the micro-batch's
    outputs = [
        flatten(p, "output", keep=[t for t, w in zip(mb, structure.whole) if w])
        for p, mb in zip(parts, micro_batches)
    ]
    assert all(s == structure for _, s in outputs)
    joined, out_structure = gather([t for t, _ in outputs], [s for _, s in outputs], "output")
    back = unflatten(out_structure, joined)
    assert torch.equal(back["h"], value["h"]) and torch.equal(back["mask"], value["mask"])
    assert torch.equal(back["ids"][0], value["ids"][0])
    assert back["rope"][1] is value["rope"][1] and back["causal"] is value["causal"]
    assert {k: back[k] for k in ("scale", "note", "flag")} == {"scale": 0.5, "note": None, "flag": True}


def test_a_table_whose_first_dimension_equals_the_batch_size_is_split_unless_marked():
    x, table = torch.randn(6, 4), torch.randn(6, 4)
    _, structure = scatter({"x": x, "rope": table}, 3)
    assert structure.whole == (False, False)  # T == N: the rule splits it
    assert no_chunk(table) is table and torch.equal(table, table.clone())  # one device: unchanged
    micro_batches, structure = scatter({"x": x, "rope": table}, 3)
    assert structure.whole == (False, True) and all(mb[1] is table for mb in micro_batches)
    # the batch size comes from the first tensor not marked: a marked table first does not set it
    micro_batches, structure = scatter((no_chunk(torch.randn(4, 2)), x), 3)
    assert structure.kind == TUPLE and structure.whole == (True, False) and len(micro_batches) == 3
    # a new tensor a layer marks stays replicated; 0-d outputs are replicated
    y = torch.randn(2, 4)
    _, out = flatten({"y": y, "t": no_chunk(torch.randn(5)), "s": torch.tensor(1.0)}, "output")
    assert out.whole == (False, True, True)


def test_leaves_the_pipeline_cannot_carry_are_refused_naming_their_path_and_the_fix():
    with pytest.raises(
        MicroBatchError, match=r"input\['cfg'\]\[1\] is a object .*pass its tensors and numbers"
    ):
        scatter({"x": torch.zeros(4, 2), "cfg": [1, object()]}, 2, what="input")
    with pytest.raises(MicroBatchError, match=r"output of pipeline stage 1\[1\] is a complex"):
        flatten((torch.zeros(2), 1j), "output of pipeline stage 1")
    with pytest.raises(MicroBatchError, match="no tensor with a batch dimension.*shapes: \\(\\)"):
        scatter({"s": torch.tensor(2.0), "n": 3}, 2)
    with pytest.raises(MicroBatchError, match="no tensor with a batch dimension"):
        scatter({"x": no_chunk(torch.zeros(4, 2))}, 2)
    with pytest.raises(TypeError, match="no_chunk marks a tensor"):
        no_chunk([1, 2])


def test_joining_refuses_outputs_that_differ_between_micro_batches():
    mean = [{"y": torch.ones(2, 3), "loss": torch.tensor(float(i))} for i in range(2)]
    flat = [flatten(v, "out") for v in mean]
    with pytest.raises(
        MicroBatchError, match=r"out\['loss'\] is a 0-d tensor that differs between micro-batches 0 and 1"
    ):
        gather([t for t, _ in flat], [s for _, s in flat], "out")
    counts = [flatten({"y": torch.ones(2, 3), "n": n}, "out") for n in (3, 2)]
    with pytest.raises(
        MicroBatchError, match=r"differs between micro-batches 0 and 1 \(at \['n'\]: 3 and 2\)"
    ):
        gather([t for t, _ in counts], [s for _, s in counts], "out")
    shapes = [flatten({"y": torch.ones(2, k)}, "out") for k in (3, 4)]
    with pytest.raises(MicroBatchError, match=r"out\['y'\]: micro-batch outputs cannot be concatenated"):
        gather([t for t, _ in shapes], [s for _, s in shapes], "out")
    marked = [flatten({"t": no_chunk(torch.ones(3)) if i else torch.ones(3)}, "out") for i in range(2)]
    with pytest.raises(
        MicroBatchError, match=r"the tensor at \['t'\] is replicated in one and not in the other"
    ):
        gather([t for t, _ in marked], [s for _, s in marked], "out")
    scalars = [flatten(torch.tensor(float(i)), "output of the last pipeline stage (2)") for i in range(2)]
    with pytest.raises(MicroBatchError, match=r"stage \(2\) is a 0-d tensor that differs .* \(0.0 and 1.0\)"):
        gather([t for t, _ in scalars], [s for _, s in scalars], "output of the last pipeline stage (2)")
    same = [flatten({"y": torch.ones(2, 3), "loss": torch.tensor(1.5)}, "out") for _ in range(3)]
    joined, structure = gather([t for t, _ in same], [s for _, s in same], "out")
    assert joined[0].shape == (6, 3) and joined[1].item() == 1.5


def test_a_tensor_or_a_tuple_of_batch_tensors_splits_and_joins_as_before():
    x, ids = torch.randn(10, 3), torch.arange(10)
    for value, kind in ((x, TENSOR), ((x, ids), TUPLE)):
        micro_batches, structure = scatter(value, 4)
        assert structure.kind == kind and not any(structure.whole)
        expected = split((x,) if kind == TENSOR else (x, ids), 4)
        assert all(all(torch.equal(a, b) for a, b in zip(mb, e)) for mb, e in zip(micro_batches, expected))
        joined, _ = gather(micro_batches, [structure] * 4, "out")
        assert all(torch.equal(a, b) for a, b in zip(joined, join(expected)))


def test_gathering_one_micro_batch_returns_its_tensors_without_a_copy():
    out = {"y": torch.randn(4, 3), "mask": no_chunk(torch.ones(2))}
    tensors, structure = flatten(out, "output")
    (joined, mask), _ = gather([tensors], [structure], "output")
    assert joined is tensors[0] and mask is tensors[1]
    two, _ = gather([tensors, tensors], [structure, structure], "output")
    assert two[0].shape == (8, 3) and two[0].data_ptr() != tensors[0].data_ptr()  # several are joined
