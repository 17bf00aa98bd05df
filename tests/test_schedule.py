from collections import Counter

import pytest

from lightning_gpipe.schedule import (
    SCHEDULES,
    Action,
    Transfer,
    bubble_share,
    fill_drain,
    format_grid,
    ideal_bubble,
    messages,
    needs_loss,
    receives,
    sends,
    split_phases,
    stage_actions,
    validate,
)
from lightning_gpipe.skip import Route

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
    assert SCHEDULES["fill_drain"] is fill_drain


def test_phases_cut_each_column_before_its_first_backward():
    for j in range(3):
        forward, backward = split_phases(stage_actions(fill_drain(3, 4), j))
        assert forward == [Action("F", i) for i in range(4)]
        assert backward == [Action("B", i) for i in (3, 2, 1, 0)]
    assert split_phases([Action("F", 0)]) == ([Action("F", 0)], [])
    assert needs_loss(Action("B", 0), 2, 3) and not needs_loss(Action("B", 0), 1, 3)
    assert not needs_loss(Action("F", 0), 2, 3)


def test_messages_each_action_receives_and_sends_mirror_each_other():
    skips = [Route("a", 0, 2), Route("b", 1, 2), Route("c", 2, 2)]  # "c" stays on its stage: no message
    F, B = Action("F", 1), Action("B", 1)
    assert receives(F, 0, 3, skips) == [] and sends(F, 0, 3, skips) == [Transfer(1), Transfer(2, "a")]
    assert receives(F, 1, 3, skips) == [Transfer(0)] and sends(F, 1, 3, skips) == [
        Transfer(2),
        Transfer(2, "b"),
    ]
    assert receives(F, 2, 3, skips) == [Transfer(1), Transfer(0, "a"), Transfer(1, "b")]
    assert sends(F, 2, 3, skips) == []
    assert receives(B, 2, 3, skips) == [] and sends(B, 2, 3, skips) == [
        Transfer(1),
        Transfer(0, "a"),
        Transfer(1, "b"),
    ]
    assert receives(B, 1, 3, skips) == [Transfer(2), Transfer(2, "b")] and sends(B, 1, 3, skips) == [
        Transfer(0)
    ]
    assert receives(B, 0, 3, skips) == [Transfer(1), Transfer(2, "a")] and sends(B, 0, 3, skips) == []
    # every message sent is received by its peer, in the same order per pair of stages
    for action in (F, B):
        for j in range(3):
            for t in sends(action, j, 3, skips):
                assert Transfer(j, t.skip) in receives(action, t.peer, 3, skips)


def test_message_counts_follow_the_actions():
    skips = [Route("a", 0, 2)]
    forward, backward = split_phases(stage_actions(fill_drain(3, 4), 2))
    assert messages(forward, 2, 3, skips) == Counter({1: 4, 0: 4})
    assert messages(backward, 2, 3, skips) == Counter()
    forward, backward = split_phases(stage_actions(fill_drain(3, 4), 0))
    assert messages(forward, 0, 3, skips) == Counter()
    assert messages(backward, 0, 3, skips) == Counter({1: 4, 2: 4})
    no_skip_grads = messages(backward, 0, 3, skips, flows=lambda action, t: t.skip is None)
    assert no_skip_grads == Counter({1: 4})
