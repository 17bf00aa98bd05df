"""Recompute changes nothing but the arithmetic: every effect of a forward happens once per micro-batch.

In-process tests run one stage (no communication) with each checkpoint mode against
``checkpoint="never"``; one multi-process job runs the issue's failing input over 2 stages.
"""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import train_single_device


@pytest.mark.timeout(300)
def test_recompute_counts_each_sample_once_over_two_stages(gpipe_job, tmp_path):
    """The issue's input: ``seen`` counts 24 samples in 3 steps of 8 with every checkpoint mode, as on one
    device, in the trained module and in the checkpoint written during fit; every other effect equals
    ``checkpoint="never"`` (layers 0-2 on stage 0 = rank 1, layers 3-6 on stage 1 = rank 0)."""
    reference = train_single_device("effects", 0, steps=3, batch=8)
    assert int(reference.layers[1].seen) == 24
    modes = ["never", "except_last", "always"]
    results, _ = gpipe_job(
        "effects",
        2,
        [{"chunks": 2, "balance": [3, 4], "checkpoint": m} for m in modes],
        steps=3,
        batch=8,
        save_at_train_end="effects{k}.ckpt",
    )
    never = results[0]
    for mode, result in zip(modes, results):
        assert int(result["state"]["layers.1.seen"]) == 24, mode
        assert max_diff(result["state"], never["state"]) <= 1e-6, mode
        for rank in (0, 1):
            ours, ref = result["ranks"][rank], never["ranks"][rank]
            held = [k for k in ours["effects"] if (k < 3) == (rank == 1)]
            assert {k: ours["effects"][k] for k in held} == {k: ref["effects"][k] for k in held}, (mode, rank)
            assert torch.equal(ours["rng_after"], ref["rng_after"]), (mode, rank)
    assert never["ranks"][1]["effects"][1] == {"calls": 6, "sizes": [4] * 6}
    for k, mode in enumerate(modes):  # the checkpoint each run wrote inside fit
        saved = torch.load(tmp_path / f"effects{k}.ckpt", weights_only=False)
        assert int(saved["state_dict"]["layers.1.seen"]) == 24, mode
