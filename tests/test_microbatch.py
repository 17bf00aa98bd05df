import pytest
import torch

from lightning_gpipe.microbatch import MicroBatchError, as_tensors, join, sizes, split


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
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        split((torch.zeros(4),), 0)


@pytest.mark.parametrize(("n", "chunks"), [(10, 4), (2, 4), (8, 8), (7, 3), (1, 1), (9, 2)])
def test_split_sizes_follow_the_one_rule(n, chunks):
    parts = split([torch.zeros(n, 2)], chunks)
    assert [p[0].shape[0] for p in parts] == sizes(n, chunks)
    assert sizes(10, 4) == [3, 3, 2, 2] and sizes(2, 4) == [1, 1]


def test_sizes_reject_bad_counts():
    with pytest.raises(TypeError, match="chunks must be an int"):
        sizes(4, 2.0)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        sizes(0, 2)
