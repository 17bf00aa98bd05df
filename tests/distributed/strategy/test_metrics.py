"""Epoch-end metrics as on one device (issue 40, kind D; CPU, Gloo, hard timeouts): keys logged in the
LightningModule's epoch hooks reach every rank before the monitoring callbacks and the plateau
scheduler read them, and torchmetrics ``compute()`` at epoch end neither hangs nor fails on a stage
that saw no update."""

import math

import pytest

from tests.conftest import max_diff
from tests.distributed.strategy.test_step_outputs import _close
from tests.user_code import train


@pytest.mark.timeout(300)
def test_epoch_end_metrics_reach_the_monitoring_callbacks_on_every_rank(kinds_job, tmp_path):
    """2 stages, chunks 2, under "gpipe" and "1f1b": a MeanSquaredError computed and logged in
    on_train_epoch_end (and logged doubled with on_epoch=True) drives EarlyStopping (stops after epoch
    2) and ReduceLROnPlateau (halves the learning rate after epoch 2); a MetricCollection with a
    BinaryAUROC, computed in on_validation_epoch_end, drives ModelCheckpoint. On every rank the
    callbacks read one device's values, stop at the same epoch, keep the same best score and file,
    and the weights equal one device's; compute() returns one device's value on the last stage and
    NaN on stage 0, which saw no update (its BinaryAUROC of no samples would raise). The averages of
    step losses collected in lists (Lightning 2's migration guide) reach every rank as on one device,
    though the hooks that stack them raise on stage 0, where the lists stay empty."""
    reference = train("epoch", trainer={"dirpath": str(tmp_path / "ref")})
    assert reference["stopped"] == 2 and reference["lrs"] == pytest.approx([0.2, 0.2, 0.2, 0.1])
    for name in ("epoch_gpipe", "epoch_1f1b"):
        ranks = kinds_job[name]
        for record in ranks:
            for key in ("lrs", "epoch_metrics", "stopped", "epochs", "best", "best_path"):
                _close(record[key], reference[key])
            assert max_diff(record["state"], reference["state"]) <= 1e-5, name
        _close(ranks[0]["computed"], reference["computed"])
        assert all(math.isnan(v) for v in ranks[1]["computed"])
