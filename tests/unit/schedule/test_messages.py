"""The messages each action implies (:mod:`lightning_gpipe.schedule.messages`): receives and sends
mirror each other, counts per peer stage, the order each peer takes them, across virtual stages."""

from collections import Counter

from lightning_gpipe.engine.skip import Route
from lightning_gpipe.schedule import (
    SCHEDULES,
    Action,
    Transfer,
    fill_drain,
    in_send_order,
    interleaved_1f1b,
    needs_loss,
    receives,
    send_order,
    sends,
    split_phases,
    stage_actions,
)


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


def messages(actions, stage, stages, skips=(), flows=lambda action, t: True, virtual_stages=1):
    """How many messages ``actions`` receive from each peer stage."""
    return Counter(
        t.peer
        for a in actions
        for t in receives(a, stage, stages, list(skips), virtual_stages)
        if flows(a, t)
    )


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


def test_transfers_name_virtual_stages_and_wrap_from_the_last_stage_to_the_first():
    k, v = 2, 2  # stage 0: parts 0, 2; stage 1: parts 1, 3
    f0, f1, b0, b1 = Action("F", 3), Action("F", 3, 1), Action("B", 3), Action("B", 3, 1)
    assert receives(f0, 0, k, virtual_stages=v) == []  # part 0: the input of the pipeline
    assert sends(f0, 0, k, virtual_stages=v) == [Transfer(1, None, 0)]
    assert receives(f0, 1, k, virtual_stages=v) == [Transfer(0, None, 0)]
    assert sends(f0, 1, k, virtual_stages=v) == [Transfer(0, None, 1)]  # part 1 -> part 2 on stage 0
    assert receives(f1, 0, k, virtual_stages=v) == [Transfer(1, None, 0)]
    assert sends(f1, 1, k, virtual_stages=v) == []  # part 3: the last
    assert receives(b1, 1, k, virtual_stages=v) == []  # its gradient comes from the loss
    assert needs_loss(b1, 1, k, 2) and not needs_loss(b0, 1, k, 2) and not needs_loss(b1, 0, k, 2)
    assert sends(b1, 1, k, virtual_stages=v) == [Transfer(0, None, 1)]
    assert sends(b1, 0, k, virtual_stages=v) == [Transfer(1, None, 0)]  # part 2 -> part 1
    assert receives(b0, 1, k, virtual_stages=v) == [Transfer(0, None, 1)]
    assert sends(b0, 0, k, virtual_stages=v) == []
    # skips between parts: part 0 stashes "a" for part 3
    skips = [Route("a", 0, 3)]
    assert sends(f0, 0, k, skips, v) == [Transfer(1, None, 0), Transfer(1, "a", 1)]
    assert receives(f1, 1, k, skips, v) == [Transfer(0, None, 1), Transfer(0, "a", 0)]
    assert sends(b1, 1, k, skips, v) == [Transfer(0, None, 1), Transfer(0, "a", 0)]
    assert receives(b0, 0, k, skips, v) == [Transfer(1, None, 0), Transfer(1, "a", 1)]


def test_every_message_sent_is_received_by_the_action_it_names():
    for k, m, v in [(2, 4, 2), (3, 5, 2), (4, 8, 3), (2, 5, 3)]:
        grid = interleaved_1f1b(k, m, v)
        for j in range(k):
            for action in stage_actions(grid, j):
                for t in sends(action, j, k, virtual_stages=v):
                    received = receives(
                        Action(action.kind, action.i, t.virtual_stage), t.peer, k, virtual_stages=v
                    )
                    assert Transfer(j, None, action.virtual_stage) in received


def _grids():
    for name, schedule in SCHEDULES.items():
        for k in range(1, 5):
            for m in range(1, 9):
                for v in (1, 2, 3):
                    try:
                        grid = schedule(k, m, v)
                    except ValueError as err:  # a schedule may refuse virtual stages; say so
                        assert "virtual" in str(err), (name, k, m, v, err)
                        continue
                    yield name, k, m, v, grid


def test_message_order_is_consistent_for_every_schedule():
    """Per pair of stages, the messages one sends are the ones the other takes, one for one.

    Where a column takes them in the sender's order (``in_send_order``), the transport's order is
    the order they are needed. Otherwise (interleaved, two stages, an odd micro-batch group) the
    receiving stage takes them in :func:`send_order` and holds each until its action runs, which
    cannot deadlock: each message is sent before the step of the action that takes it.
    """
    unordered = []
    for name, k, m, v, grid in _grids():
        steps = {}
        for step, row in enumerate(grid):
            for j, a in enumerate(row):
                if a is not None:
                    steps[(j, a)] = step
        for stage in range(k):
            taken = [(a, t) for a in stage_actions(grid, stage) for t in receives(a, stage, k, (), v)]
            for peer in range(k):
                sent = send_order(grid, stage, peer)
                assert Counter(sent) == Counter(x for x in taken if x[1].peer == peer), (name, k, m, v)
                for a, t in sent:  # sent before the step of the action that takes it
                    assert steps[(peer, Action(a.kind, a.i, t.virtual_stage))] < steps[(stage, a)]
        if not in_send_order(grid):
            unordered.append((name, k, m, v))
    assert all(name == "interleaved_1f1b" and k == 2 and v > 1 for name, k, m, v in unordered)
    assert ("interleaved_1f1b", 2, 5, 2) in unordered  # groups of 3 and 2
    assert ("interleaved_1f1b", 2, 4, 2) not in unordered
    assert all(in_send_order(fill_drain(k, m)) for k in range(1, 5) for m in range(1, 9))


def test_messages_are_counted_per_peer_stage_across_virtual_stages():
    grid = interleaved_1f1b(2, 4, 2)
    assert messages(stage_actions(grid, 1), 1, 2, virtual_stages=2) == Counter({0: 4 + 4 + 4})
    assert messages(stage_actions(grid, 0), 0, 2, virtual_stages=2) == Counter({1: 4 + 4 + 4})
