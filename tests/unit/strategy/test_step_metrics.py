"""A torchmetrics Metric updated once per micro-batch call reports the whole batch's step value
(lightning_gpipe.strategy.step_metrics), and its epoch value sees every update, as on one device."""

import pytest
import torch
import torchmetrics
from torch import nn
from torchmetrics import Metric

from lightning_gpipe.strategy.microstep import _LogRecorder
from lightning_gpipe.strategy.step_metrics import isolate, rejoin
from tests.unit.strategy.test_microstep import FakeModule

SIZES = [3, 3, 2, 2]


class SumOfSquares(Metric):
    """A user's metric, full_state_update left at its default (None): forward's full-state path."""

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x, y):
        self.total += ((x - y) ** 2).sum()
        self.count += x.numel()

    def compute(self):
        return self.total / self.count


class Stacked(SumOfSquares):
    """A tensor state without a reduction: its state cannot be merged."""

    def __init__(self):
        super().__init__()
        self.add_state("last", torch.tensor(0.0), dist_reduce_fx=None)


def _batches(steps=3, n=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


CASES = {
    "accuracy": (
        lambda: torchmetrics.classification.MulticlassAccuracy(3, average="micro"),
        lambda x, y: (x, y),
    ),
    "mae": (torchmetrics.MeanAbsoluteError, lambda x, y: (x[:, 0], y.float())),
    "max": (torchmetrics.MaxMetric, lambda x, y: (x[:, 1],)),
    "cat": (torchmetrics.CatMetric, lambda x, y: (x[:, 2],)),
    "mean": (torchmetrics.MeanMetric, lambda x, y: (x[:, 0],)),
    "full_state": (SumOfSquares, lambda x, y: (x[:, 0], y.float())),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_value_is_the_batch_and_epoch_value_every_updates(case):
    make, args = CASES[case]
    one, holder = make(), nn.Module()
    holder.metric = ours = make()
    for x, y in _batches():
        expected = one(*args(x, y))  # one device: one forward on the whole batch
        held = isolate(holder, None)
        for xi, yi in zip(x.split(SIZES), y.split(SIZES)):  # one training_step call per micro-batch
            ours(*args(xi, yi))
        rejoin(held)
        torch.testing.assert_close(ours._forward_cache, expected)  # what Lightning logs on_step
        assert ours._update_count == one._update_count
    torch.testing.assert_close(ours.compute(), one.compute())  # the epoch value


def test_a_metric_the_step_does_not_update_keeps_its_state_and_step_value():
    holder = nn.Module()
    holder.metric = metric = torchmetrics.MeanMetric()
    metric(torch.tensor([1.0, 3.0]))
    held = isolate(holder, None)
    rejoin(held)
    assert (
        metric._forward_cache.item() == 2.0 and metric.compute().item() == 2.0 and metric._update_count == 1
    )


def test_metrics_inside_the_pipelined_sequential_are_left_alone():
    holder = nn.Module()
    holder.layers = nn.Sequential(nn.Linear(2, 2))
    holder.layers.tap = torchmetrics.MeanMetric()
    holder.layers.tap.update(torch.tensor(1.0))
    assert isolate(holder, holder.layers) == []
    assert holder.layers.tap._update_count == 1


@pytest.mark.parametrize("use", ["forward", "update"])
def test_values_a_metric_collection_returns_are_logged_as_the_batch_values(use):
    """``self.log_dict(self.metrics(logits, y))``: a macro F1 score is not a weighted mean of the
    micro-batches' scores; logged, it is the batch's, and the collection's epoch values every update's
    (``update``: its compute groups share states)."""

    def collection():
        return torchmetrics.MetricCollection(
            {
                "f1": torchmetrics.classification.MulticlassF1Score(3, average="macro"),
                "acc": torchmetrics.classification.MulticlassAccuracy(3, average="micro"),
            }
        )

    one, holder, module = collection(), nn.Module(), FakeModule()
    holder.metrics = collection()
    for step, (x, y) in enumerate(_batches()):
        if use == "forward":
            expected = one(x, y)
        else:
            one.update(x, y)
        module.logged.clear()
        held = isolate(holder, None)
        with _LogRecorder(module, [h.metric for h in held]) as log:
            for i, (xi, yi) in enumerate(zip(x.split(SIZES), y.split(SIZES))):
                log.micro_batch = i
                if use == "forward":
                    for name, value in holder.metrics(xi, yi).items():
                        module.log(name, value)
                else:
                    holder.metrics.update(xi, yi)
        rejoin(held)
        log.replay(SIZES, SIZES)
        if use == "forward":
            logged = {name: value for name, value, _ in module.logged}
            assert set(logged) == {"f1", "acc"}
            for name in logged:
                torch.testing.assert_close(logged[name], expected[name], msg=f"{name} at step {step}")
    for name, value in one.compute().items():
        torch.testing.assert_close(holder.metrics.compute()[name], value, msg=name)


def test_a_metric_whose_state_cannot_merge_is_left_alone_with_a_warning():
    holder = nn.Module()
    holder.metric = Stacked()
    with pytest.warns(UserWarning, match="Stacked has a tensor state with dist_reduce_fx=None"):
        assert isolate(holder, None) == []
