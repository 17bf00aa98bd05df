import pytest

from lightning_gpipe.schedule import (
    SCHEDULES,
    Action,
    bubble_share,
    check_schedule,
    fill_drain,
    format_grid,
    ideal_bubble,
    needs_loss,
    one_f_one_b,
    place,
    split_phases,
    stage_actions,
    validate,
)

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


def test_schedule_actions_are_fill_then_drain_in_reverse():
    actions = [[(a.kind, a.i) for a in stage_actions(fill_drain(2, 3), j)] for j in range(2)]
    assert actions == [[("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]] * 2


@pytest.mark.parametrize("k,m", [(1, 1), (1, 4), (2, 3), (3, 4), (4, 8)])
def test_ideal_bubble_is_the_bubble_share_of_fill_drain(k, m):
    assert ideal_bubble(k, m) == pytest.approx(bubble_share(fill_drain(k, m)))
    assert SCHEDULES["gpipe"] is fill_drain


def test_phases_cut_each_column_before_its_first_backward():
    for j in range(3):
        forward, backward = split_phases(stage_actions(fill_drain(3, 4), j))
        assert forward == [Action("F", i) for i in range(4)]
        assert backward == [Action("B", i) for i in (3, 2, 1, 0)]
    assert split_phases([Action("F", 0)]) == ([Action("F", 0)], [])
    assert needs_loss(Action("B", 0), 2, 3) and not needs_loss(Action("B", 0), 1, 3)
    assert not needs_loss(Action("F", 0), 2, 3)


ONE_F_ONE_B_K3_M4 = """\
step  stage0  stage1  stage2
   0  F0      .       .
   1  F1      F0      .
   2  F2      F1      F0
   3  .       .       B0
   4  .       B0      F1
   5  B0      F2      B1
   6  F3      B1      F2
   7  B1      F3      B2
   8  .       B2      F3
   9  B2      .       B3
  10  .       B3      .
  11  B3      .       ."""


def test_one_f_one_b_grid_for_three_stages_and_four_micro_batches():
    """K=3, M=4, unit-time actions: warm-up forwards K-1-j, then one forward one backward, then cool-down."""
    grid = one_f_one_b(3, 4)
    assert format_grid(grid) == ONE_F_ONE_B_K3_M4
    validate(grid)
    assert SCHEDULES["1f1b"] is one_f_one_b and ideal_bubble(3, 4) == pytest.approx(bubble_share(grid))


def test_one_f_one_b_columns_are_megatrons_figure_4_top():
    """Megatron-LM (Narayanan et al. SC 2021) figure 4 top: 4 devices, 8 micro-batches; each device's
    order of forwards (numbers) and backwards (shaded numbers), micro-batches counted from 1."""
    figure = [
        "1 2 3 4 1b 5 2b 6 3b 7 4b 8 5b 6b 7b 8b",
        "1 2 3 1b 4 2b 5 3b 6 4b 7 5b 8 6b 7b 8b",
        "1 2 1b 3 2b 4 3b 5 4b 6 5b 7 6b 8 7b 8b",
        "1 1b 2 2b 3 3b 4 4b 5 5b 6 6b 7 7b 8 8b",
    ]
    grid = one_f_one_b(4, 8)
    for j, row in enumerate(figure):
        expected = [
            Action("B", int(c[:-1]) - 1) if c.endswith("b") else Action("F", int(c) - 1) for c in row.split()
        ]
        assert stage_actions(grid, j) == expected


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_one_f_one_b_holds_at_most_k_minus_j_micro_batches_on_stage_j(k, m):
    grid = one_f_one_b(k, m)
    validate(grid)
    assert len(grid) == 2 * (m + k - 1)
    for j in range(k):
        column, in_flight, peak = stage_actions(grid, j), 0, 0
        for a in column:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(k - j, m)
        assert [a.i for a in column if a.kind == "B"] == list(range(m))  # backwards in micro-batch order
    fill = fill_drain(k, m)
    assert max(sum(a.kind == "F" for a in stage_actions(fill, 0)[:n]) for n in range(2 * m + 1)) == m


def test_placing_fill_drains_columns_gives_its_grid():
    for k, m in [(1, 1), (2, 3), (3, 4)]:
        assert place([stage_actions(fill_drain(k, m), j) for j in range(k)]) == fill_drain(k, m)
    with pytest.raises(ValueError, match="wait on each other forever"):
        place([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])


def test_an_unknown_schedule_is_refused_with_the_choices():
    assert check_schedule("1f1b") == "1f1b"
    with pytest.raises(
        ValueError, match=r"schedule must be one of 'gpipe', '1f1b'.* \(schedule: 'interleaved'\)"
    ):
        check_schedule("interleaved")
