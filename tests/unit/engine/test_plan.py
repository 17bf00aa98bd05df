"""A column's plan (:class:`lightning_gpipe.engine.plan.ColumnPlan`): what each action receives and
sends, as the schedule's own functions name it, made once per step shape."""

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.plan import ColumnPlan, taking_order
from lightning_gpipe.engine.skip import Route
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.schedule import (
    Action,
    Post,
    fill_drain,
    interleaved_1f1b,
    needs_loss,
    one_f_one_b,
    receives,
    sends,
    stage_actions,
    with_posts,
    zb_h1,
)
from lightning_gpipe.transport.layout import Layout, StageTopology
from lightning_gpipe.transport.p2p import P2P


def _topology(stage, stages, skips=()):
    layout = Layout(stages, stages)
    return layout.topology(next(r for r in range(stages) if layout.stage_of(r) == stage), skips)


CASES = [
    (fill_drain(3, 4), 1, ()),
    (one_f_one_b(3, 5), 1, (Route("s", 0, 2),)),
    (interleaved_1f1b(2, 4, 2), 2, (Route("s", 0, 3), Route("t", 1, 2))),
    (interleaved_1f1b(2, 5, 2), 2, ()),  # takers' order differs from the senders'
]


@pytest.mark.parametrize("grid,v,skips", CASES)
def test_the_plan_names_what_the_schedule_functions_name(grid, v, skips):
    stages = len(grid[0])
    for stage in range(stages):
        top = _topology(stage, stages, skips)
        plan = ColumnPlan.of(grid, top, v, train=True)
        column = stage_actions(grid, stage)
        outcome = stages - 1 if stage < stages - 1 else None  # one call per micro-batch: its post too
        assert list(plan.column) == with_posts(column, stage, stages, skips, v, outcome=outcome)
        assert [a for a in plan.column if isinstance(a, Action)] == column
        assert plan.fill_end == 1 + max(k for k, a in enumerate(plan.column) if a.kind == "F")
        for a in column:
            assert list(plan.receives[a]) == receives(a, stage, stages, skips, v)
            assert list(plan.sends[a]) == sends(a, stage, stages, skips, v)
            assert (a in plan.needs_loss) == needs_loss(a, stage, stages, v)
        expected = taking_order(grid, top, v) if v > 1 else {}
        assert {p: list(keys) for p, keys in plan.order.items()} == expected


def test_an_evaluation_plan_runs_the_forwards_only_and_holds_no_sends():
    grid = interleaved_1f1b(2, 5, 2)
    plan = ColumnPlan.of(grid, _topology(1, 2), 2, train=False)
    forwards = [a for a in stage_actions(grid, 1) if a.kind == "F"]
    assert [a for a in plan.column if isinstance(a, Action)] == forwards
    assert all(a.kind in "FR" for a in plan.column)  # and the posts of the messages they take
    assert plan.fill_end == len(plan.column) and not plan.needs_loss and plan.order == {}


def test_a_stage_plans_once_per_step_shape_and_each_run_consumes_its_own_order():
    top = StageTopology(stage=1, stages=2, prev_rank=0, next_rank=None, ranks=(0, 1))
    stage = PipelineStage(
        [("a", nn.Linear(2, 2)), ("b", nn.Linear(2, 2))],
        top,
        chunks=5,
        checkpoint="never",
        p2p=P2P(torch.device("cpu")),
        schedule=interleaved_1f1b,
        virtual_layers=[["a"], ["b"]],
    )
    stage._micro = 5
    first, second = (
        stage.executor._new_run(True, 5, whole=False),
        stage.executor._new_run(True, 5, whole=False),
    )
    assert first.plan is second.plan  # planned once
    assert first.order == second.order and first.order and first.order is not second.order
    first.order[0].pop(0)  # the outbox consumes a run's order: the next run's is whole
    assert stage.executor._new_run(True, 5, whole=False).order == second.order
    assert stage.executor._new_run(True, 4, whole=False).plan is not first.plan  # another M: another plan
    assert stage.executor._new_run(False, 5, whole=False).plan is not first.plan  # evaluation: forwards only


@pytest.mark.parametrize(
    "grid,v,skips", [*CASES, (zb_h1(2, 4), 1, ()), (zb_h1(4, 8), 1, (Route("s", 0, 3),))]
)
def test_the_stages_before_the_last_post_the_outcome_under_one_call_per_micro_batch(grid, v, skips):
    """One call per micro-batch: each stage before the last holds one post of the step outcome from
    the last stage (:func:`~lightning_gpipe.schedule.with_posts` places it); the last stage, a step of
    one call and evaluation hold none."""
    stages = len(grid[0])
    for stage in range(stages):
        top = _topology(stage, stages, skips)
        plans = [ColumnPlan.of(grid, top, v, True), ColumnPlan.of(grid, top, v, True, whole=True)]
        counts = [
            [str(p) for p in plan.column if isinstance(p, Post) and p.action is None]
            for plan in [*plans, ColumnPlan.of(grid, top, v, False)]
        ]
        assert counts == [[f"RO<{stages - 1}"] if stage < stages - 1 else [], [], []], stage


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_last_stage_leaves_the_weight_passes_after_its_last_message_to_the_drain(stages):
    """One call per micro-batch: the last stage's ``drain_start`` is where its trailing ``W``s begin;
    every other stage, a step of one call (``whole``), evaluation and a column without ``W`` run
    to the end with the calls."""
    for grid in (zb_h1(stages, 2 * stages), one_f_one_b(stages, 4)):
        for stage in range(stages):
            top = _topology(stage, stages)
            plan = ColumnPlan.of(grid, top, 1, train=True)
            kinds = [a.kind for a in plan.column if isinstance(a, Action)]
            if stage == stages - 1 and "W" in kinds:
                assert plan.column[plan.drain_start - 1].kind != "W"
                assert {a.kind for a in plan.column[plan.drain_start :]} == {"W"}
                assert len(plan.column) - plan.drain_start == stages  # ZB-H1: W_{M-K} .. W_{M-1}
            else:
                assert plan.drain_start == len(plan.column)
            for other in (ColumnPlan.of(grid, top, 1, True, whole=True), ColumnPlan.of(grid, top, 1, False)):
                assert other.drain_start == len(other.column)
