import pytest

from lightning_gpipe.schedule import Action, bubble_share, fill_drain, format_grid, stage_actions, validate

EXPECTED_K3_M4 = """\
step  stage0  stage1  stage2
   0  F0      .       .
   1  F1      F0      .
   2  F2      F1      F0
   3  F3      F2      F1
   4  .       F3      F2
   5  .       .       F3
   6  .       .       B3
   7  .       B3      B2
   8  B3      B2      B1
   9  B2      B1      B0
  10  B1      B0      .
  11  B0      .       ."""


def test_fill_drain_grid_k3_m4_matches_table():
    assert format_grid(fill_drain(3, 4)) == EXPECTED_K3_M4


def test_fill_drain_k2_m2_literal():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    assert fill_drain(2, 2) == [
        [F(0), None],
        [F(1), F(0)],
        [None, F(1)],
        [None, B(1)],
        [B(1), B(0)],
        [B(0), None],
    ]


@pytest.mark.parametrize("k,m", [(1, 1), (1, 5), (2, 3), (3, 4), (4, 8), (5, 2)])
def test_fill_drain_is_valid_and_bubble_matches_gpipe(k, m):
    grid = fill_drain(k, m)
    validate(grid)
    assert len(grid) == 2 * (m + k - 1)
    assert bubble_share(grid) == pytest.approx((k - 1) / (m + k - 1))
    for j in range(k):
        actions = stage_actions(grid, j)
        assert actions == [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]


def test_validate_rejects_backward_before_gradient_arrives():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    grid = [[F(0), None], [F(1), F(0)], [None, F(1)], [B(1), B(1)], [None, B(0)], [B(0), None]]
    with pytest.raises(ValueError, match="B1 on stage 0 runs before its gradient from stage 1"):
        validate(grid)


def test_validate_rejects_missing_action():
    grid = fill_drain(2, 2)
    grid[5][0] = None
    with pytest.raises(ValueError, match="stage 0 never runs B0"):
        validate(grid)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="chunks: 0"):
        fill_drain(2, 0)
