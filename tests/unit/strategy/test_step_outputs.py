"""What training_step's micro-batch calls return, combined into the batch's
(lightning_gpipe.strategy.step_outputs), and token-count losses: one step of a two-stage pipeline in one
process equals one device."""

import copy
import math
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.stage import PipelineStage, StageDone
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import SCHEDULES, one_f_one_b
from lightning_gpipe.strategy.microstep import MicroSteps
from lightning_gpipe.strategy.step_outputs import (
    combine,
    combine_outputs,
    gradient_scale,
    loss_weights,
    num_items_of,
)
from lightning_gpipe.transport.layout import Layout, StageTopology
from lightning_gpipe.transport.p2p import P2P
from tests.fakes import TurnNetwork, TurnP2P, in_threads
from tests.unit.strategy.test_microstep import Backward, FakeModule

SIZES = [3, 3, 2, 2]
WEIGHTS = [0.3, 0.3, 0.2, 0.2]
TIGHT = {"atol": 1e-6, "rtol": 1e-5}


def test_tensors_with_a_dimension_are_concatenated_along_dim_0():
    parts = [torch.arange(n * 2.0).reshape(n, 2) + 10 * i for i, n in enumerate(SIZES)]
    assert torch.equal(combine(parts, WEIGHTS, SIZES), torch.cat(parts))
    ints = [torch.full((n,), i) for i, n in enumerate(SIZES)]
    assert combine(ints, WEIGHTS, SIZES).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_floats_average_like_the_loss_and_integers_add_up():
    accuracies = [1.0, 0.0, 0.5, 0.5]  # per micro-batch means: the batch's is weighted by size
    assert combine(accuracies, WEIGHTS, SIZES) == pytest.approx(0.3 + 0.1 + 0.1)
    mean = combine([torch.tensor(a) for a in accuracies], WEIGHTS, SIZES)
    assert mean.dtype == torch.float32 and mean.item() == pytest.approx(0.5)
    assert combine(SIZES, WEIGHTS, SIZES) == 10  # "n": x.shape[0] is the batch's N
    correct = combine([torch.tensor(k) for k in (3, 1, 2, 0)], WEIGHTS, SIZES)
    assert correct.dtype == torch.int64 and correct.item() == 6
    # a call with weight 0 (num_items 0: a NaN mean) is left out of a mean
    assert combine([0.5, math.nan, 1.0], [0.5, 0.0, 0.5], [2, 2, 2]) == pytest.approx(0.75)


def test_containers_combine_entry_by_entry_and_others_are_the_last_calls():
    calls = [
        {
            "preds": torch.ones(n, 1) * i,
            "stats": OrderedDict(acc=float(i), seen=n),
            "pair": (torch.zeros(n), "tag"),
            "scores": [0.5] * n,  # per-sample values: as long as the micro-batch
            "ids": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"],  # whole in every call
            "flag": i % 2 == 0,
            "name": f"call{i}",
        }
        for i, n in enumerate(SIZES)
    ]
    out = combine(calls, WEIGHTS, SIZES)
    assert out["preds"].flatten().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert type(out["stats"]) is OrderedDict and out["stats"]["seen"] == 10
    assert out["stats"]["acc"] == pytest.approx(0.3 * 1 + 0.2 * 2 + 0.2 * 3)
    assert out["pair"][0].shape == (10,) and out["pair"][1] == "tag" and type(out["pair"]) is tuple
    assert out["scores"] == [0.5] * 10
    assert out["ids"] == calls[0]["ids"]
    assert out["flag"] is False and out["name"] == "call3"


def test_values_that_cannot_be_combined_are_the_last_calls():
    ragged = [torch.zeros(n, k) for n, k in zip(SIZES, (1, 2, 1, 1))]  # shapes beyond dim 0 differ
    assert combine(ragged, WEIGHTS, SIZES) is ragged[-1]
    keys = [{"a": 1}, {"a": 1}, {"b": 2}, {"a": 1}]
    assert combine(keys, WEIGHTS, SIZES) is keys[-1]
    assert combine([None, None, None, None], WEIGHTS, SIZES) is None
    assert combine([1, "x", 2, 3], WEIGHTS, SIZES) == 3


def test_num_items_weights_each_call_by_its_items():
    assert loss_weights(SIZES, [None] * 4) == pytest.approx(WEIGHTS)
    assert loss_weights(SIZES, [6.0, 0.0, 3.0, 1.0]) == pytest.approx([0.6, 0.0, 0.3, 0.1])
    # the backwards run with k_i / (M k_ref), k_ref the first nonzero count; the step's gradients
    # then take M k_ref / K
    assert gradient_scale([0.0, 4.0, 3.0, 1.0], 4) == (4.0, 4 * 4.0 / 8.0)
    assert gradient_scale([None, None], 2) == (None, 1.0)
    with pytest.raises(PipelineUsageError, match=r"but not for micro-batches \[1\]"):
        loss_weights(SIZES[:2], [2.0, None])
    assert num_items_of({"loss": 0, "num_items": torch.tensor(7)}, 0) == 7.0
    assert num_items_of({"loss": 0}, 0) is None and num_items_of(torch.tensor(1.0), 0) is None
    with pytest.raises(PipelineUsageError, match="num_items='7' for micro-batch 2"):
        num_items_of({"loss": 0, "num_items": "7"}, 2)
    # num_items itself is summed, whatever its type
    kept = [{"num_items": torch.tensor(k, dtype=torch.float32)} for k in (6.0, 0.0, 3.0, 1.0)]
    assert combine_outputs(kept, [0.6, 0.0, 0.3, 0.1], SIZES)["num_items"].item() == 10.0


# -- one step of a two-stage pipeline, training_step once per micro-batch, in one process ----------

VOCAB = 30


def _lm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def _batch(rows=8, length=5):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = torch.randint(0, VOCAB, (rows, length), generator=g)
    for r in range(rows):
        labels[r, 1 + (r * 3) % length :] = -100  # 1..5 valid tokens per row
    labels[2:4] = -100  # micro-batch 1 of 4 (rows 2, 3) has no valid token: its mean is NaN
    return ids, labels


class Module(FakeModule):
    """What MicroSteps needs of a LightningModule (FakeModule's log), with a token accuracy metric."""

    def __init__(self, stage):
        super().__init__()
        self.stage, self._trainer = stage, None
        self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro", ignore_index=-100)

    def parameters(self):
        return self.stage.parameters()

    def modules(self):
        yield from self.stage.modules()
        yield self.acc


def _user_step(stage, module):
    """One-device code: a token-mean cross-entropy returned with its token count, and extras."""

    def training_step(batch, batch_idx):
        ids, labels = batch
        logits = stage(ids)  # other stages leave here
        flat, target = logits.reshape(-1, VOCAB), labels.reshape(-1)
        loss = F.cross_entropy(flat, target, ignore_index=-100)
        valid = target != -100
        module.acc(flat, target)
        module.log("train_loss", loss)
        correct = (flat.argmax(-1) == target)[valid]
        return {
            "loss": loss,
            "num_items": valid.sum(),
            "preds": logits.argmax(-1),
            "n": ids.shape[0],
            "token_acc": correct.float().mean() if correct.numel() else torch.tensor(math.nan),
            "tag": "lm",
        }

    return training_step


def _one_device(seq, batch):
    ids, labels = batch
    logits = seq(ids)
    flat, target = logits.reshape(-1, VOCAB), labels.reshape(-1)
    loss = F.cross_entropy(flat, target, ignore_index=-100)
    loss.backward()
    valid = target != -100
    acc = torchmetrics.functional.accuracy(
        flat, target, "multiclass", num_classes=VOCAB, average="micro", ignore_index=-100
    )
    token_acc = (flat.argmax(-1) == target)[valid].float().mean()
    return loss.detach(), logits.argmax(-1), int(valid.sum()), acc, token_acc


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1"])
def test_token_count_loss_and_step_outputs_equal_one_device_on_every_stage(schedule):
    """K = 2 stages (v = 2 under interleaving), M = 4 micro-batches of 2 sequences with 0 to 10 valid
    tokens (one micro-batch none): the loss logged and returned, the gradients (added to gradients
    already accumulated), the outputs every stage's hooks get and the metric's step value equal
    one device's."""
    seq, batch, chunks, k = _lm(), _batch(), 4, 2
    v = 2 if schedule == "interleaved_1f1b" else 1
    ref = copy.deepcopy(seq)
    loss, preds, items, acc, token_acc = _one_device(ref, batch)
    earlier = {n: torch.full_like(p, 0.5) for n, p in seq.named_parameters()}  # accumulated before
    for n, p in seq.named_parameters():
        p.grad = earlier[n].clone()
    network, stages = TurnNetwork(), []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        balance = uniform_balance(len(seq), k * v)
        checkpoint = "never" if schedule == "zb_h1" else "except_last"
        stage = build_stage(
            seq, balance, Layout(k, k), rank, chunks, checkpoint, torch.device("cpu"), SCHEDULES[schedule]
        )
        stage.p2p = TurnP2P(network, rank)
        stages.append(stage)
    modules = {id(s): Module(s) for s in stages}
    shared = {}

    def body(stage):
        module, steps = modules[id(stage)], MicroSteps()
        out = steps.training_step(_user_step(stage, module), stage, module, Backward(), chunks, batch, 0)
        assert (out is StageDone) == (not stage.topology.is_last)
        shared[stage.topology.stage] = stage.share_outcome(out, None, training=True)
        steps.finish(stage.backward)  # as lightning_gpipe.strategy.steps.drain
        steps.deposit(stage.step_gradient_scale)

    in_threads(stages, body, turn=network.turn)
    for j, out in shared.items():  # what on_train_batch_end(outputs) gets on each stage
        assert sorted(out) == ["loss", "n", "num_items", "preds", "tag", "token_acc"], j
        torch.testing.assert_close(out["loss"].detach().float(), loss, **TIGHT)
        assert torch.equal(out["preds"], preds) and out["n"] == 8 and int(out["num_items"]) == items
        torch.testing.assert_close(out["token_acc"], token_acc, **TIGHT)
        assert out["tag"] == "lm"
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(seq.named_parameters())[n].grad, earlier[n] + p.grad, **TIGHT, msg=n)
    last = modules[id(stages[-1])]
    ((name, logged, _),) = last.logged
    assert name == "train_loss" and logged.item() == pytest.approx(loss.item(), rel=1e-5)
    assert last.acc._forward_cache.item() == pytest.approx(acc.item())  # the step value: the batch's
    assert last.acc.compute().item() == pytest.approx(acc.item())  # the epoch value: every call's updates


def test_ignore_index_targets_without_num_items_are_warned_about_once():
    torch.manual_seed(0)
    stage = PipelineStage(
        [("0", nn.Linear(4, 3))], StageTopology(0, 1, None, None), 2, "never", P2P(torch.device("cpu")),
        schedule=one_f_one_b,
    )  # fmt: skip
    module, steps = Module(stage), MicroSteps()
    labels = torch.tensor([0, -100, 2, 1])
    batch = (torch.randn(4, 4), labels)

    def training_step(batch, batch_idx):
        x, y = batch
        return F.cross_entropy(stage(x), y, ignore_index=-100)

    with pytest.warns(
        UserWarning, match=r"targets equal to -100 \(ignore_index\) and training_step returns no"
    ):
        steps.training_step(training_step, stage, module, Backward(), 2, batch, 0)
    steps.deposit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per fit, not every step
        steps.training_step(training_step, stage, module, Backward(), 2, batch, 1)
