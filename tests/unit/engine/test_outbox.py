"""The outbox (:func:`lightning_gpipe.engine.plan.release`): which sends wait, and that they leave
in the taker's order."""

from lightning_gpipe.engine.plan import release, taking_order
from lightning_gpipe.schedule import fill_drain, interleaved_1f1b, sends, stage_actions
from lightning_gpipe.transport.layout import Layout


def _topology(stage, stages):
    layout = Layout(stages, stages)
    return layout.topology(next(r for r in range(stages) if layout.stage_of(r) == stage))


def test_nothing_waits_where_every_peer_takes_the_messages_in_send_order():
    assert taking_order(fill_drain(2, 4), _topology(0, 2), 1) == {}
    assert taking_order(interleaved_1f1b(2, 4, 2), _topology(1, 2), 2) == {}
    assert taking_order(interleaved_1f1b(3, 5, 2), _topology(1, 3), 2) == {}


def test_two_stages_with_an_odd_group_hold_what_they_send_for_the_takers_order():
    grid = interleaved_1f1b(2, 5, 2)  # groups of 3 and 2
    for stage, peer in ((0, 1), (1, 0)):
        order = taking_order(grid, _topology(stage, 2), 2)
        sent = [
            (a.kind, a.i, a.virtual_stage, t.skip)
            for a in stage_actions(grid, stage)
            for t in sends(a, stage, 2, (), 2)
            if t.peer == peer
        ]
        assert set(order) == {peer}
        assert sorted(order[peer]) == sorted(sent)  # every message sent, once
    assert any(
        taking_order(grid, _topology(s, 2), 2)[1 - s]
        != [
            (a.kind, a.i, a.virtual_stage, t.skip)
            for a in stage_actions(grid, s)
            for t in sends(a, s, 2, (), 2)
            if t.peer == 1 - s
        ]
        for s in (0, 1)
    )  # somewhere the taker's order is not the sender's


def test_release_returns_the_held_items_whose_turn_has_come_in_order():
    f0, b0, f1 = ("F", 0, 0, None), ("B", 0, 1, None), ("F", 1, 0, None)
    order, box = [f0, b0, f1], {}
    assert release(order, box, b0, "b0") == []
    assert release(order, box, f0, "f0") == ["f0", "b0"]
    assert release(order, box, f1, "f1") == ["f1"]
    assert order == [] and box == {}
