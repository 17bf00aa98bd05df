"""One training_step per micro-batch (lightning_gpipe.strategy.microstep): the batch split and the
combined logs."""

import pytest
import torch
import torchmetrics

from lightning_gpipe.engine.microbatch import no_chunk
from lightning_gpipe.strategy.microstep import _LogRecorder, split_batch


def test_every_tensor_of_the_batch_splits_like_the_input():
    batch = {"x": torch.arange(10.0).reshape(10, 1), "pair": (torch.arange(10), "tag"), "n": 3}
    parts, sizes = split_batch(batch, 4)
    assert sizes == [3, 3, 2, 2]
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [p["pair"][0].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert all(p["pair"][1] == "tag" and p["n"] == 3 for p in parts)
    assert split_batch((torch.zeros(2, 3), torch.zeros(2)), 4)[1] == [1, 1]  # N < M: N micro-batches
    assert split_batch({"x": torch.zeros(12, 3)}, 8, 2)[1] == [2] * 6  # BatchNorm: 2 samples or more


def test_tensors_without_the_batch_dimension_reach_every_call_whole():
    table, scale, mark = torch.zeros(7, 2), torch.tensor(2.0), no_chunk(torch.zeros(10, 3))
    parts, sizes = split_batch((torch.zeros(10, 2), table, scale, mark), 3)
    assert sizes == [4, 3, 3] and [p[0].shape[0] for p in parts] == [4, 3, 3]
    assert all(p[1] is table and p[2] is scale and p[3] is mark for p in parts)


@pytest.mark.parametrize("batch", [(torch.tensor(1.0),), ("no tensors",), (no_chunk(torch.zeros(4, 2)),)])
def test_a_batch_without_a_batch_dimension_is_refused(batch):
    with pytest.raises(
        ValueError, match=r"holds no tensor with a batch dimension \(shapes: .*\); .* schedule='gpipe'"
    ):
        split_batch(batch, 2)


class FakeModule:
    """Has LightningModule.log's signature; keeps what is logged."""

    def __init__(self):
        self.logged = []

    def log(  # noqa: PLR0913 - LightningModule.log's own signature
        self, name, value, prog_bar=False, logger=None, on_step=None, on_epoch=None, reduce_fx="mean",
        enable_graph=False, sync_dist=False, sync_dist_group=None, add_dataloader_idx=True,
        batch_size=None, metric_attribute=None, rank_zero_only=False,
    ):  # fmt: skip
        options = {
            "prog_bar": prog_bar,
            "reduce_fx": reduce_fx,
            "batch_size": batch_size,
            "sync_dist": sync_dist,
        }
        self.logged.append((name, value, options))


def test_values_logged_per_micro_batch_are_logged_once_combined_by_size():
    module, metric = FakeModule(), torchmetrics.MeanMetric()
    sizes = [3, 3, 2, 2]
    with _LogRecorder(module) as log:
        for i, n in enumerate(sizes):
            log.micro_batch = i
            module.log("loss", torch.tensor(float(i)), prog_bar=True)
            module.log("count", n, reduce_fx="sum", batch_size=n)
            module.log(
                "worst", torch.tensor(float(-i)), False, None, None, None, "max"
            )  # options by position
            metric.update(torch.tensor(float(i)))
            module.log("metric", metric)
    assert module.logged == [] and "log" not in module.__dict__  # recorded, and the method is back
    log.replay(sizes)
    logged = {name: (value, options) for name, value, options in module.logged}
    assert len(module.logged) == 4
    value, options = logged["loss"]
    assert value.item() == pytest.approx((0 * 3 + 1 * 3 + 2 * 2 + 3 * 2) / 10) and options["prog_bar"] is True
    value, options = logged["count"]
    assert value.item() == 10 and options["batch_size"] == 10 and options["reduce_fx"] == "sum"
    assert logged["worst"][0].item() == 0.0
    assert logged["metric"][0] is metric


class StageModule(FakeModule):
    """What MicroSteps needs of a LightningModule: its parameters, log (recorded), no trainer."""

    def __init__(self, stage):
        super().__init__()
        self.stage, self._trainer = stage, None

    def parameters(self):
        return self.stage.parameters()

    def modules(self):
        return self.stage.modules()


class Backward:
    """A precision plugin's backward: the loss's own."""

    def backward(self, tensor, module, *args):
        tensor.backward()


def live_bytes_after_each_micro_batch(chunks, returns, rows=32, width=64):
    """One 1F1B step of a one-stage pipeline (M = ``chunks`` micro-batches of ``rows`` rows) under
    the tensor-memory meter: its live bytes after each micro-batch's backward, and its peak."""
    from lightning_gpipe.engine.stage import PipelineStage
    from lightning_gpipe.schedule import one_f_one_b
    from lightning_gpipe.strategy.microstep import MicroSteps
    from lightning_gpipe.tools.meter import TensorMemoryMeter
    from lightning_gpipe.transport.layout import StageTopology
    from lightning_gpipe.transport.p2p import P2P

    torch.manual_seed(0)
    layers = [(str(k), torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())) for k in range(2)]
    stage = PipelineStage(
        layers,
        StageTopology(0, 1, None, None),
        chunks,
        "never",
        P2P(torch.device("cpu")),
        schedule=one_f_one_b,
    )
    module = StageModule(stage)
    batch = (torch.randn(rows * chunks, width), torch.randn(rows * chunks, width))

    def training_step(batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(stage(x), y)  # a 0-d view of a micro-batch-sized buffer
        if returns == "logged":
            module.log("loss", loss)  # the value with its graph
        return {"loss": loss, "n": x.shape[0]} if returns == "dict" else loss

    lives = []
    backpropagated = stage.loss_backpropagated

    def loss_backpropagated(i):
        backpropagated(i)
        lives.append(meter.live)

    stage.loss_backpropagated = loss_backpropagated
    steps = MicroSteps()
    with TensorMemoryMeter() as meter:
        out = steps.training_step(training_step, stage, module, Backward(), chunks, batch, 0)
    loss = out["loss"] if returns == "dict" else out
    return lives, meter.peak, loss, rows * width * 4


@pytest.mark.parametrize("returns", ["loss", "logged", "dict"])
def test_one_f_one_b_keeps_no_micro_batch_sized_tensor_to_the_end_of_the_step(returns):
    # 1F1B's activation memory is flat in M: what a call leaves once its backward has run (its
    # loss value, a logged value, its output) must not hold a micro-batch-sized tensor. The
    # loss of F.mse_loss views its element-wise buffer (rows × width floats): kept as it is,
    # it grew the step's memory by one micro-batch's output per micro-batch.
    lives4, peak4, loss4, micro = live_bytes_after_each_micro_batch(4, returns)
    lives8, peak8, loss8, _ = live_bytes_after_each_micro_batch(8, returns)
    assert max(lives8) - lives8[0] < micro // 4, lives8  # after micro-batch i: no growth with i
    assert max(lives8) - max(lives4) < micro // 4 and peak8 - peak4 < micro // 4, (peak4, peak8)
    assert loss4.untyped_storage().nbytes() == loss8.untyped_storage().nbytes() == 4


def test_a_nan_from_a_one_sample_micro_batch_is_left_out_of_the_logged_value_with_a_warning():
    # torch.std of one sample is NaN: a 10-sample batch in 4 calls of 3, 3, 3, 1 must not log NaN
    module, sizes = FakeModule(), [3, 3, 3, 1]
    with _LogRecorder(module) as log:
        for i, n in enumerate(sizes):
            log.micro_batch = i
            module.log("spread", torch.arange(float(n)).std() if n > 1 else torch.tensor([5.0]).std())
            module.log("nan", torch.tensor(float("nan")))  # NaN in every call: NaN, as on one device
    with pytest.warns(UserWarning, match="'spread' logged NaN for a micro-batch of one sample"):
        log.replay(sizes, sizes)
    logged = {name: value for name, value, _ in module.logged}
    assert logged["spread"].item() == pytest.approx(1.0) and torch.isnan(logged["nan"])


def test_a_call_that_returns_none_is_refused_with_advice_that_works_on_several_processes():
    # Lightning refuses None from training_step on more than one process under any strategy
    # (pytorch-lightning PR 19918), so the advice is DDP's: a zero loss that keeps the graph
    from lightning_gpipe.engine.stage import PipelineStage
    from lightning_gpipe.errors import PipelineUsageError
    from lightning_gpipe.schedule import one_f_one_b
    from lightning_gpipe.strategy.microstep import MicroSteps
    from lightning_gpipe.transport.layout import StageTopology
    from lightning_gpipe.transport.p2p import P2P

    stage = PipelineStage(
        [("0", torch.nn.Linear(4, 4))],
        StageTopology(0, 1, None, None),
        2,
        "never",
        P2P(torch.device("cpu")),
        schedule=one_f_one_b,
    )

    def training_step(batch, batch_idx):
        stage(batch[0])
        return None

    batch = (torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(PipelineUsageError, match=r"returned no loss for micro-batch 0 .*`loss \* 0`") as err:
        MicroSteps().training_step(training_step, stage, StageModule(stage), Backward(), 2, batch, 0)
    assert "schedule='gpipe'" not in str(err.value)
