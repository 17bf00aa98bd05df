"""Epoch-end metrics on the stages that compute no loss (issue 40, kind D), in one process: a metric
there never syncs and its ``compute()`` is harmless; the module's ``on_train_epoch_end`` shares the
last stage's metrics after its own code."""

import pytest
import torch
import torchmetrics
from torch import nn

from lightning_gpipe.strategy.epoch_end import guard_epoch_end_hooks
from lightning_gpipe.strategy.metrics import remove_metric_sharing, sync_metrics_over
from tests.models import pl


def _never(*args, **kwargs):
    raise AssertionError("synced: on a stage the last stage does not join, this all_gather would hang")


def _metrics() -> nn.ModuleDict:
    """Metrics that believe a process group is up and would sync through ``_never``."""
    kwargs = {"distributed_available_fn": lambda: True, "dist_sync_fn": _never}
    collection = torchmetrics.MetricCollection(
        {
            "mae": torchmetrics.MeanAbsoluteError(**kwargs),
            "auroc": torchmetrics.classification.BinaryAUROC(**kwargs),
        }
    )
    return nn.ModuleDict({"mse": torchmetrics.MeanSquaredError(**kwargs), "val": collection})


def test_a_metric_on_another_stage_never_syncs_and_computes_harmlessly():
    """Unchanged, compute() syncs (torchmetrics reads ``_to_sync``, which ``sync_on_compute = False``
    does not refresh); on a non-last stage it does not, returns torchmetrics' NaN of an empty mean,
    and NaN where torchmetrics raises (BinaryAUROC of no samples); a state that saw updates keeps its
    value and its errors."""
    plain = _metrics()
    plain["mse"].update(torch.ones(2), torch.zeros(2))
    plain["mse"].sync_on_compute = False
    with pytest.raises(AssertionError, match="synced"):
        plain["mse"].compute()

    metrics = _metrics()
    sync_metrics_over(metrics, None, member=False)
    assert torch.isnan(metrics["mse"].compute())
    values = metrics["val"].compute()
    assert torch.isnan(values["mae"]) and torch.isnan(values["auroc"])
    metrics["mse"].update(torch.ones(2), torch.zeros(2))
    assert metrics["mse"].compute() == 1.0
    metrics["val"]["auroc"].update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
    assert metrics["val"]["auroc"].compute() == 1.0
    sync_metrics_over(metrics, None, member=False)  # again (validate after fit): wrapped once
    assert metrics["mse"].compute() == 1.0


class _Hooked(pl.LightningModule):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def on_train_epoch_end(self):
        self.seen.append("module")


def test_the_modules_train_epoch_end_shares_after_its_own_code():
    seen: list[str] = []
    module = _Hooked(seen)
    guard_epoch_end_hooks(module, True, lambda: seen.append("share"), {})
    module.on_train_epoch_end()
    assert seen == ["module", "share"]
    remove_metric_sharing(module, None)
    module.on_train_epoch_end()
    assert seen == ["module", "share", "module"]
