"""BatchNorm under micro-batches (issue 40, kind E). ``batch_norm="batch"`` (the default): a BatchNorm
in training mode under M > 1 micro-batches is refused at its first forward, naming the layer and the
fixes, while frozen (eval-mode) BatchNorm, ``chunks=1`` and evaluation train as one device.
``batch_norm="micro_batch"``: a model with BatchNorm never gets a training micro-batch of one sample,
each micro-batch is normalized by its own statistics (GPipe), and models without BatchNorm split as
before. One stage in one process, driven as the strategy drives it, against the plain layers."""

import copy

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm
from lightning_gpipe.engine.microbatch import sizes
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.strategy.batch_norm import (
    batch_norms,
    check_batch_norm,
    keep_two_samples,
    refusals,
    refuse_training_batch_norm,
)
from lightning_gpipe.strategy.pipelined import Pipelined, StageSpec, partition_model
from lightning_gpipe.transport.layout import Layout, StageTopology
from lightning_gpipe.transport.p2p import P2P
from tests.fakes import micro_step

CPU = torch.device("cpu")


def _stage(seq: nn.Sequential, chunks: int, batch_norm: str = "micro_batch") -> PipelineStage:
    """``seq`` as the only stage of a pipeline, ``chunks`` micro-batches, as the strategy sets it up
    (:func:`lightning_gpipe.strategy.pipelined.partition_model`) for ``batch_norm``; the Sequential is
    the module's ``layers``."""
    stage = PipelineStage(
        list(seq._modules.items()),
        StageTopology(0, 1, None, None),
        chunks,
        "except_last",
        P2P(CPU),
    )
    if check_batch_norm(batch_norm) == "micro_batch":
        keep_two_samples(stage, batch_norms(seq))
    refusals(stage, "layers.", chunks, batch_norm)
    return stage


def _train_step(stage: PipelineStage, x: torch.Tensor) -> torch.Tensor:
    """One ``"gpipe"`` training step: one call, the loss's backward, the stage's backward."""
    stage.begin_step(True)
    out = stage(x)
    stage.end_step()
    out.pow(2).mean().backward()
    stage.backward()
    return out.detach()


def _micro_steps(stage: PipelineStage, x: torch.Tensor) -> torch.Tensor:
    """One ``"1f1b"`` training step (:func:`tests.fakes.micro_step`): a call per micro-batch of the
    stage's chunks, each loss (weighted n_i / N) backpropagated; returns the calls' outputs, joined."""
    outs = []

    def training_step(part: torch.Tensor) -> torch.Tensor:
        out = stage(part)
        outs.append(out.detach())
        return out.pow(2).mean()

    micro_step(stage, x, training_step)
    return torch.cat(outs)


def _per_part(seq: nn.Sequential, x: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """One device as GPipe defines the step: the layers on each micro-batch in turn."""
    out = torch.cat([seq(part) for part in x.split(parts)])
    out.pow(2).mean().backward()
    return out.detach()


def _mlp(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), norm, nn.Tanh(), nn.Linear(32, 1))


def _assert_as_one_device(seq: nn.Sequential, reference: nn.Sequential) -> None:
    """Gradients and buffers (running statistics, ``num_batches_tracked``) equal the reference's."""
    for (name, p), q in zip(seq.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(seq.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)


# -- batch_norm="batch" (the default) ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_training_batch_norm_under_several_micro_batches_is_refused_at_its_first_forward(schedule):
    """Training BatchNorm, chunks 4, a batch of 8: the first forward of the BatchNorm raises
    PipelineUsageError naming the layer as in the user's module, M, and every fix, before the
    BatchNorm ran (its running statistics untouched) and before any backward (no gradient)."""
    seq = _mlp(nn.BatchNorm1d(32))
    stage = _stage(seq, 4, "batch")
    x = torch.randn(8, 16)
    with pytest.raises(PipelineUsageError) as info:
        if schedule == "gpipe":
            _train_step(stage, x)
        else:
            _micro_steps(stage, x)
    message = str(info.value)
    head = "BatchNorm layer 'layers.1' (stage 0) runs in training mode on a step split into 4 micro-batches"
    assert message.startswith(head)
    for fix in ("(chunks=4)", "chunks=1", "GroupNorm", "LayerNorm", "batch_norm='micro_batch'"):
        assert fix in message, fix
    assert "deferred_batch_norm=True" in message and "eval mode (frozen)" in message
    assert seq[1].num_batches_tracked.item() == 0 and seq[1].running_mean.abs().sum() == 0
    assert all(p.grad is None for p in seq.parameters())


def test_a_deferred_batch_norm_missed_by_an_isinstance_freeze_is_named_as_such():
    """Under deferred_batch_norm=True the stage's BatchNorm1d is a DeferredBatchNorm: a freeze by
    ``isinstance(m, nn.BatchNorm1d)`` misses it, and the refusal says so and how to test for it; a plain
    BatchNorm's refusal does not."""
    seq = convert_deferred_batch_norm(_mlp(nn.BatchNorm1d(32)))
    for m in seq.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()
    with pytest.raises(PipelineUsageError) as info:
        _train_step(_stage(seq, 2, "batch"), torch.randn(8, 16))
    assert str(info.value).endswith(
        "train under any chunks. Under deferred_batch_norm=True it is a DeferredBatchNorm, not an "
        "nn.BatchNorm1d/2d/3d: to freeze it test isinstance(m, nn.modules.batchnorm._BatchNorm)"
    )
    with pytest.raises(PipelineUsageError, match=r"train under any chunks$"):
        _train_step(_stage(_mlp(nn.BatchNorm1d(32)), 2, "batch"), torch.randn(8, 16))


def test_the_refusal_names_a_batch_norm_nested_in_a_block():
    """A BatchNorm2d inside a conv block (``layers.0.1``) is named by its path."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    stage = _stage(nn.Sequential(block, nn.Flatten(), nn.Linear(64, 1)), 2, "batch")
    with pytest.raises(PipelineUsageError, match=r"^BatchNorm layer 'layers\.0\.1' \(stage 0\) .* into 2 "):
        _train_step(stage, torch.randn(4, 3, 6, 6))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_frozen_batch_norm_trains_as_one_device_under_several_micro_batches(schedule):
    """BatchNorm put in eval mode (as fine-tuning freezes it, e.g. in on_train_epoch_start) normalizes
    by its running statistics: chunks 4 on a batch of 4 (micro-batches of one sample, no floor under
    "batch") trains equal to one device on the whole batch, and the running statistics stay."""
    seq = _mlp(nn.BatchNorm1d(32))
    with torch.no_grad():
        seq[1].running_mean.uniform_(-0.5, 0.5)
        seq[1].running_var.uniform_(0.5, 2.0)
    reference = copy.deepcopy(seq)
    stage = _stage(seq, 4, "batch")
    seq[1].eval()
    reference[1].eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    out = _train_step(stage, x) if schedule == "gpipe" else _micro_steps(stage, x)
    expected = reference(x)
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected.detach())
    _assert_as_one_device(seq, reference)


def test_chunks_1_with_training_batch_norm_trains_as_one_device():
    """chunks=1: the BatchNorm sees the whole batch; outputs, gradients and running statistics equal
    one device's (no refusal)."""
    seq = _mlp(nn.BatchNorm1d(32))
    reference = copy.deepcopy(seq)
    stage = _stage(seq, 1, "batch")
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    out = _train_step(stage, x)
    expected = reference(x)
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected.detach())
    _assert_as_one_device(seq, reference)
    assert seq[1].num_batches_tracked.item() == 1


def test_evaluation_is_never_refused_and_the_hooks_come_off():
    """An evaluation step over 4 micro-batches is not refused, even with the BatchNorm left in training
    mode (it then normalizes each micro-batch by itself, as the plain layers on each part); once the
    hooks are removed (the strategy does at teardown) a training step is no longer refused."""
    seq = _mlp(nn.BatchNorm1d(32))
    reference = copy.deepcopy(seq)
    stage = PipelineStage(
        list(seq._modules.items()),
        StageTopology(0, 1, None, None),
        4,
        "except_last",
        P2P(CPU),
    )
    hooks = refuse_training_batch_norm(stage, "layers.", 4)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    stage.begin_step(False)
    with torch.no_grad():
        out = stage(x)
    stage.end_step()
    with torch.no_grad():
        expected = torch.cat([reference(part) for part in x.split(2)])
    torch.testing.assert_close(out, expected)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(_train_step(stage, x), _per_part(reference, x, [2] * 4))


@pytest.mark.parametrize("value", ["batches", "micro-batch", None, True])
def test_a_bad_batch_norm_value_is_named(value):
    with pytest.raises(ValueError, match=rf"batch_norm={value!r} is not one of 'batch' .* or 'micro_batch'"):
        check_batch_norm(value)


def test_instance_norm_is_not_refused_and_trains_as_one_device_but_its_running_statistics():
    """InstanceNorm (a ``_NormBase``, not a ``_BatchNorm``) normalizes each sample by itself: chunks 4 is
    not refused and outputs and gradients equal one device's; with ``track_running_stats`` its running
    mean gets 4 momentum updates, not one, so it differs (docs/models.md#batchnorm says so)."""
    torch.manual_seed(0)
    norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
    seq = nn.Sequential(nn.Conv1d(3, 4, 3), norm, nn.Flatten(), nn.Linear(24, 1))
    reference = copy.deepcopy(seq)
    x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(_train_step(_stage(seq, 4, "batch"), x), _per_part(reference, x, [8]))
    for p, q in zip(seq.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert not torch.allclose(seq[1].running_mean, reference[1].running_mean)


# -- SyncBatchNorm (either mode) ---------------------------------------------------------------------


@pytest.fixture
def two_ranks(monkeypatch):
    """An initialized job of 2 ranks, as ``torch.distributed`` reports it to a SyncBatchNorm."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)


@pytest.mark.parametrize("batch_norm", ["batch", "micro_batch"])
def test_a_training_sync_batch_norm_over_every_rank_is_refused_in_either_mode(two_ranks, batch_norm):
    """A SyncBatchNorm (process group None: every rank) in training mode would all-gather statistics
    from the other stages' ranks, which run other layers: refused at its forward, even with chunks=1,
    naming the layer and the fix, before it ran (running statistics untouched)."""
    seq = _mlp(nn.SyncBatchNorm(32))
    stage = _stage(seq, 1, batch_norm)
    with pytest.raises(PipelineUsageError) as info:
        _train_step(stage, torch.randn(8, 16))
    message = str(info.value)
    assert message.startswith("SyncBatchNorm layer 'layers.1' (stage 0) runs in training mode")
    for fix in ("nn.BatchNorm1d/2d/3d", "convert_sync_batchnorm", "deferred_batch_norm=True", "eval mode"):
        assert fix in message, fix
    assert seq[1].num_batches_tracked.item() == 0


def test_a_sync_batch_norm_under_several_micro_batches_is_named_as_sync_first(two_ranks):
    """Under ``"batch"`` and chunks 4 the SyncBatchNorm's own refusal comes first: its fix is not chunks=1."""
    stage = _stage(_mlp(nn.SyncBatchNorm(32)), 4, "batch")
    with pytest.raises(PipelineUsageError, match=r"^SyncBatchNorm layer 'layers\.1'"):
        _train_step(stage, torch.randn(8, 16))


def test_a_frozen_sync_batch_norm_trains_as_one_device(two_ranks):
    """In eval mode a SyncBatchNorm does not synchronize: not refused, and the step equals one device's."""
    seq = _mlp(nn.SyncBatchNorm(32))
    seq[1].eval()
    reference = copy.deepcopy(seq)
    stage = _stage(seq, 4, "batch")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_train_step(stage, x), _per_part(reference, x, [8]))
    _assert_as_one_device(seq, reference)


def test_a_sync_batch_norm_outside_a_job_or_with_its_own_group_is_not_refused(monkeypatch):
    """Without an initialized job a SyncBatchNorm is a BatchNorm (chunks=1: as one device); with a
    process group of its own (the user's choice of ranks) it is left to the user."""
    seq = _mlp(nn.SyncBatchNorm(32))
    reference = copy.deepcopy(seq)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_train_step(_stage(seq, 1, "batch"), x), _per_part(reference, x, [8]))
    _assert_as_one_device(seq, reference)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    own = _mlp(nn.SyncBatchNorm(32, process_group=object()))  # type: ignore[arg-type]
    calls = []
    monkeypatch.setattr(own[1], "forward", lambda input: calls.append(input.shape) or input)
    _train_step(_stage(own, 1, "micro_batch"), torch.randn(8, 16))
    assert calls == [torch.Size([8, 32])]


# -- batch_norm="micro_batch" (GPipe's semantics) ----------------------------------------------------


@pytest.mark.parametrize(("n", "chunks", "parts"), [(12, 8, [2] * 6), (13, 4, [4, 3, 3, 3]), (5, 4, [3, 2])])
def test_a_batch_norm_model_keeps_two_samples_in_every_training_micro_batch(n, chunks, parts):
    """A batch of 12 under chunks 8 (the default 4·K for K = 2) runs as 6 micro-batches of 2, not
    2, 2, 2, 2, 1, 1, 1, 1: outputs, gradients and running statistics equal the plain layers applied
    to each 2-sample slice (BatchNorm1d raises on one sample); uneven batches keep 2 or more too."""
    seq = _mlp(nn.BatchNorm1d(32))
    reference = copy.deepcopy(seq)
    stage = _stage(seq, chunks)
    assert sizes(n, chunks, 2) == parts
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_train_step(stage, x), _per_part(reference, x, parts))
    for (name, p), q in zip(seq.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(seq[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(seq[1].running_var, reference[1].running_var)


def test_evaluation_and_a_conv_net_with_batch_norm_2d():
    """Evaluation splits a batch of 4 into 4 single samples (BatchNorm in eval mode normalizes each
    sample alike: equal to one device on the whole batch); a conv net's BatchNorm2d is found and
    keeps 2 samples per training micro-batch."""
    seq = _mlp(nn.BatchNorm1d(32))
    stage = _stage(seq, 8)
    seq.eval()
    x = torch.randn(4, 16)
    stage.begin_step(False)
    with torch.no_grad():
        out = stage(x)
    stage.end_step()
    torch.testing.assert_close(out, seq(x))

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 1))
    reference = copy.deepcopy(conv)
    assert batch_norms(conv) == ["1"]
    stage = _stage(conv, 8)
    assert stage.executor.min_micro_batch == 2
    images = torch.randn(6, 3, 6, 6)
    torch.testing.assert_close(_train_step(stage, images), _per_part(reference, images, [2, 2, 2]))


def test_group_norm_models_still_split_into_single_samples(recwarn):
    """GroupNorm normalizes each sample by itself: a batch of 4 under chunks 8 runs as 4 micro-batches
    of one sample, with no warning, and equals one device on the whole batch."""
    seq = _mlp(nn.GroupNorm(4, 32))
    reference = copy.deepcopy(seq)
    stage = _stage(seq, 8)
    assert batch_norms(seq) == [] and stage.executor.min_micro_batch == 1
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    out = reference(x)
    out.pow(2).mean().backward()
    torch.testing.assert_close(_train_step(stage, x), out.detach())
    for p, q in zip(seq.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert not [w for w in recwarn if "BatchNorm" in str(w.message)]


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp(nn.BatchNorm1d(32))


@pytest.mark.parametrize("batch_norm", ["batch", "micro_batch"])
def test_the_strategy_glue_installs_the_refusal_or_the_floor_and_uninstall_takes_the_hooks_off(batch_norm):
    """``partition_model`` (one stage, as setup runs it): under ``"batch"`` the module's training step
    over 4 micro-batches is refused, naming ``layers.1``; under ``"micro_batch"`` the floor of 2 samples
    is set and nothing refuses. After ``uninstall`` the user's BatchNorm holds no hook of ours."""
    module, layout, pipelined = _Module(), Layout(1, 1), Pipelined()
    norm = module.layers[1]
    spec = StageSpec(
        None, None, 4, "except_last", "gpipe", 1, False, False, 2.0, False, batch_norm=batch_norm
    )
    partition_model(pipelined, module, spec, layout, 0, CPU, None, lambda x: x, lambda x: x)
    stage = module.layers
    assert isinstance(stage, PipelineStage)
    assert len(norm._forward_pre_hooks) == (batch_norm == "batch")
    stage.begin_step(True)
    if batch_norm == "batch":
        with pytest.raises(PipelineUsageError, match=r"^BatchNorm layer 'layers\.1' \(stage 0\)"):
            stage(torch.randn(8, 16))
    else:
        stage(torch.randn(8, 16))
        assert stage.executor.min_micro_batch == 2
    stage.end_step()
    pipelined.uninstall(layout, 0, lambda operation: None, gather=False)
    assert module.layers[1] is norm and len(norm._forward_pre_hooks) == 0
