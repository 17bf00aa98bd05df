"""Code that means the whole model sees it on every rank, as on one device (issue 40, kind A; CPU, Gloo,
hard timeouts): gradient norms, a hand clip and the parameter count in the gradient hooks, aux losses
declared by layers on every stage."""

import pytest

from tests.conftest import max_diff
from tests.distributed.strategy.test_step_outputs import _close, _job
from tests.user_code import train


@pytest.mark.timeout(300)
def test_gradient_hooks_and_declared_aux_losses_see_the_whole_model_on_every_rank(tmp_path):
    """2 stages, batches of 8, 3 steps; a layer declaring an aux loss on each stage. Under "gpipe" (chunks 2,
    checkpoint "except_last") and "1f1b" (chunks 3: micro-batches 3, 3, 2; checkpoint "always") every rank
    sees one device's values in its hooks: grad_norm(self) per parameter (every stage's keys) and in
    total, grad_norm(self, "inf"), the total norm a hand clip_grad_norm_(self.parameters(), 0.5) returns,
    sum(p.numel() for p in self.parameters()), and take_aux_losses(); rank 0 logs the total norm; the
    weights, clipped by hand and trained with both aux losses, equal one device's."""
    reference = train("whole")
    runs = [
        {"case": "whole", "strategy": {"chunks": 2, "checkpoint": "except_last"}},
        {"case": "whole", "strategy": {"chunks": 3, "schedule": "1f1b", "checkpoint": "always"}},
    ]
    for ranks in _job(tmp_path, runs):
        for record in ranks:
            for key in ("counts", "norms", "inf", "clipped", "aux"):
                _close(record[key], reference[key])
            assert max_diff(record["state"], reference["state"]) <= 1e-5
        _close(ranks[0]["logged"], reference["logged"])
