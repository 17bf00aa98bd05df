"""Receives posted ahead as actions of a column (:mod:`lightning_gpipe.schedule.posts`): placed by
:func:`with_posts` for every schedule, checked by :func:`validate`."""

import pytest

from lightning_gpipe.engine.skip import Route
from lightning_gpipe.schedule import (
    POSTED_AHEAD,
    SCHEDULES,
    Action,
    Post,
    Transfer,
    receives,
    stage_actions,
    validate,
    with_posts,
)

GRIDS = [
    (name, k, m, v, skips)
    for name in SCHEDULES
    for k in (1, 2, 3, 4)
    for m in (1, 2, 3, 4, 8)
    for v in ((2, 3) if name == "interleaved_1f1b" else (1,))
    for skips in ((), (Route("s", 0, k * v - 1),))
    if not (name == "interleaved_1f1b" and k == 1)
]


def _columns(grid, skips, v, hold_backwards=False):
    k = len(grid[0])
    return {j: with_posts(stage_actions(grid, j), j, k, skips, v, hold_backwards) for j in range(k)}


@pytest.mark.parametrize("name,k,m,v,skips", GRIDS)
def test_every_message_is_posted_once_in_order_before_it_is_taken_and_never_too_far_ahead(
    name, k, m, v, skips
):
    grid = SCHEDULES[name](k, m, v) if v > 1 else SCHEDULES[name](k, m)
    for hold_backwards in (False, True):
        columns = _columns(grid, skips, v, hold_backwards)
        validate(grid, columns, skips)  # the rules, checked independently below
        for j, column in columns.items():
            actions = [a for a in column if isinstance(a, Action)]
            assert actions == stage_actions(grid, j)
            taken = [Post(a, t) for a in actions for t in receives(a, j, k, skips, v)]
            posts = [p for p in column if isinstance(p, Post)]
            assert sorted(posts, key=taken.index) == taken  # each once
            for peer in range(k):  # in the order taken, per peer
                assert [p for p in posts if p.transfer.peer == peer] == [
                    p for p in taken if p.transfer.peer == peer
                ]
            for p in taken:
                assert column.index(p) < column.index(p.action)
            if j > 0:  # the first message taken is the first posted: it tells the stage M
                assert column[0] == Post(Action("F", 0), Transfer(j - 1))
            fill = next(n for n, a in enumerate(actions) if a.kind != "F")  # forwards before any backward
            for p in posts:
                if hold_backwards and p.action.kind != "F" and fill > 0:
                    assert column.index(p) > column.index(actions[fill - 1])
            if not hold_backwards:  # as far ahead as allowed: per peer, the first ones at the start
                start = next(n for n, a in enumerate(column) if isinstance(a, Action))
                for peer in range(k):
                    first = [p for p in taken if p.transfer.peer == peer][: POSTED_AHEAD + 1]
                    assert all(column.index(p) < start for p in first)


def test_a_gpipe_column_posts_its_backwards_messages_after_its_forwards():
    grid = SCHEDULES["gpipe"](2, 4)
    assert " ".join(map(str, with_posts(stage_actions(grid, 0), 0, 2, hold_backwards=True))) == (
        "F0 F1 F2 F3 RB3<1 RB2<1 RB1<1 B3 RB0<1 B2 B1 B0"
    )
    assert " ".join(map(str, with_posts(stage_actions(grid, 1), 1, 2))) == (
        "RF0<0 RF1<0 RF2<0 F0 RF3<0 F1 F2 F3 B3 B2 B1 B0"
    )


def test_an_evaluation_column_of_forwards_only_validates():
    grid = SCHEDULES["1f1b"](3, 4)
    forwards = [a for a in stage_actions(grid, 2) if a.kind == "F"]
    validate(grid, {2: with_posts(forwards, 2, 3)})


def _broken(column, what):
    column = list(column)
    posts = [n for n, a in enumerate(column) if isinstance(a, Post)]
    if what == "missing":
        del column[posts[-1]]
    elif what == "twice":
        column.insert(posts[-1], column[posts[-1]])
    elif what == "late":  # a post moved after the action that takes it
        p = column.pop(posts[-1])
        column.insert(column.index(p.action) + 1, p)
    elif what == "order":
        a, b = posts[0], posts[1]
        column[a], column[b] = column[b], column[a]
    elif what == "ahead":  # every post at the start
        column = [a for a in column if isinstance(a, Post)] + [a for a in column if isinstance(a, Action)]
    elif what == "actions":
        actions = [n for n, a in enumerate(column) if isinstance(a, Action)]
        column[actions[0]], column[actions[1]] = column[actions[1]], column[actions[0]]
    return column


@pytest.mark.parametrize("name,k,m,v,skips", GRIDS)
def test_the_outcome_is_posted_once_as_the_last_stages_message_after_its_last_one_taken(name, k, m, v, skips):
    """With ``outcome``, a stage before the last posts the step outcome once, as the last stage's
    message after the last one its column takes: right after that message's post where the receives
    posted ahead allow it (its post follows every other post from the last stage), else once enough
    of them are taken; the outcome then counts among the receives posted ahead."""
    grid = SCHEDULES[name](k, m, v) if v > 1 else SCHEDULES[name](k, m)
    for j in range(k - 1):
        column = with_posts(stage_actions(grid, j), j, k, skips, v, outcome=k - 1)
        validate(grid, {j: column}, skips)
        at = [n for n, p in enumerate(column) if isinstance(p, Post) and p.action is None]
        assert len(at) == 1 and column[at[0]].transfer.peer == k - 1
        from_last = [n for n, p in enumerate(column) if isinstance(p, Post) and p.transfer.peer == k - 1]
        assert from_last[-1] == at[0]  # after every other post from the last stage
        takes = {  # per action, the messages from the last stage it takes
            n: sum(t.peer == k - 1 for t in receives(a, j, k, skips, v))
            for n, a in enumerate(column)
            if isinstance(a, Action)
        }
        after = sum(c for n, c in takes.items() if n > at[0])  # posted, not taken: the outcome's company
        assert after <= POSTED_AHEAD
        start = from_last[-2] if len(from_last) > 1 else 0
        if any(n in takes for n in range(start, at[0])):  # not with the previous post: once the limit let it
            previous = max(n for n in takes if n < at[0])  # the action it follows
            assert after + takes[previous] > POSTED_AHEAD


def test_the_outcome_is_posted_before_the_columns_last_actions_take_their_messages():
    """Interleaved 1F1B, K = 2, v = 2, M = 8: the first stage's column does not
    end with the outcome's post; the receive travels while it runs its last backwards."""
    grid = SCHEDULES["interleaved_1f1b"](2, 8, 2)
    column = with_posts(stage_actions(grid, 0), 0, 2, virtual_stages=2, outcome=1)
    validate(grid, {0: column})
    at = next(n for n, p in enumerate(column) if isinstance(p, Post) and p.action is None)
    later = [a for a in column[at + 1 :] if isinstance(a, Action)]
    assert [str(a) for a in later[-1:]] == [str(stage_actions(grid, 0)[-1])]
    assert sum(1 for a in later if receives(a, 0, 2, [], 2)) == POSTED_AHEAD


def test_validate_refuses_an_outcome_posted_before_the_other_messages_of_its_stage_or_twice():
    grid = SCHEDULES["zb_h1"](2, 4)
    column = with_posts(stage_actions(grid, 0), 0, 2, outcome=1)
    validate(grid, {0: column})
    outcome = next(p for p in column if isinstance(p, Post) and p.action is None)
    last_post = max(n for n, p in enumerate(column) if isinstance(p, Post) and p != outcome)
    early = [p for p in column if p != outcome]
    early.insert(last_post - 1, outcome)  # before the last post of a message from stage 1
    for broken, message in (
        (early, "out of the order|twice or before that stage's other messages"),
        ([*column, outcome], "twice or before that stage's other messages"),
    ):
        with pytest.raises(ValueError, match=message):
            validate(grid, {0: broken})


def test_validate_counts_the_outcome_among_the_receives_posted_ahead():
    """The outcome posted right after the last stage's last message posted, where that puts more
    than POSTED_AHEAD + 1 of its receives ahead, is refused."""
    grid = SCHEDULES["interleaved_1f1b"](2, 8, 2)
    column = with_posts(stage_actions(grid, 0), 0, 2, virtual_stages=2, outcome=1)
    outcome = next(p for p in column if isinstance(p, Post) and p.action is None)
    rest = [p for p in column if p != outcome]
    last_post = max(n for n, p in enumerate(rest) if isinstance(p, Post) and p.transfer.peer == 1)
    rest.insert(last_post + 1, outcome)
    with pytest.raises(ValueError, match="receives ahead"):
        validate(grid, {0: rest})


@pytest.mark.parametrize(
    "what,message",
    [
        ("missing", "not posted before it"),
        ("twice", "out of the order"),
        ("late", "not posted before it"),
        ("order", "out of the order"),
        ("ahead", "more than 3 receives ahead"),
        ("actions", "runs other actions than the grid's"),
    ],
)
def test_validate_refuses_a_column_whose_posts_break_a_rule_naming_the_stage(what, message):
    grid = SCHEDULES["1f1b"](2, 6)
    column = with_posts(stage_actions(grid, 1), 1, 2)
    validate(grid, {1: column})
    with pytest.raises(ValueError, match=message) as err:
        validate(grid, {1: _broken(column, what)})
    assert "stage 1's column" in str(err.value)
