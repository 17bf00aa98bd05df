"""The stage executor (:mod:`lightning_gpipe.engine.executor`): the schedule column it runs.

The executor tests run K stages in one process over a fake transport (no torch.distributed):
every stage's forward phase in stage order, the loss, every stage's backward phase in reverse
stage order. Sends never block, so this order completes any fill-drain step.
"""

import json

import pytest

from lightning_gpipe.schedule import (
    SCHEDULES,
    stage_actions,
)
from tests._harness import check, run_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2, 3])  # one stage: test_transparency
def test_every_rank_of_a_run_executes_exactly_its_column(tmp_path, k):
    """K processes over torch.distributed, M in {1, 3, 4}, fill-drain with one call per step, 1F1B and
    ZB-H1 with one call per micro-batch: the recorded actions are the schedule's. Under ZB-H1 every
    stage but the first (whose input needs no gradient: one backward, its W does nothing) runs each
    W as a weight-gradient pass of its own, where the grid puts it; under the others only the
    drain's last backward is followed by one (tests/unit/engine/test_backward_split.py)."""
    for result in run_ranks("tests/workers/schedule_run.py", k, str(tmp_path), "1", "3", "4", timeout=240):
        check(result)
    for rank in range(k):
        recorded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(recorded) == sorted(
            f"{name}:{m}" for name in ("gpipe", "1f1b", "zb_h1") for m in (1, 3, 4)
        )
        for key, run in recorded.items():
            name, m = key.split(":")
            grid, j = SCHEDULES[name](k, int(m)), run["stage"]
            expected = [str(a) for a in stage_actions(grid, j) if a.kind != "W" or j > 0]
            actions = [a for a in run["actions"] if name == "zb_h1" or not a.startswith("W")]
            assert actions == expected, f"{name}: K={k}, M={m}, stage {j}"
