"""BatchNorm under micro-batches (issue 40, kind E): a model with BatchNorm never gets a training
micro-batch of one sample, each micro-batch is normalized by its own statistics (GPipe), and models
without BatchNorm split as before. One stage in one process, against the plain layers."""

import copy

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.microbatch import sizes
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.strategy.batch_norm import batch_norms, keep_two_samples
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P


def _stage(seq: nn.Sequential, chunks: int) -> PipelineStage:
    """``seq`` as the only stage of a pipeline, ``chunks`` micro-batches, as the strategy sets it up."""
    stage = PipelineStage(
        list(seq._modules.items()),
        StageTopology(0, 1, None, None),
        chunks,
        "except_last",
        P2P(torch.device("cpu")),
    )
    keep_two_samples(stage, batch_norms(seq), chunks)
    return stage


def _train_step(stage: PipelineStage, x: torch.Tensor) -> torch.Tensor:
    stage.begin_step(True)
    out = stage(x)
    stage.end_step()
    out.pow(2).mean().backward()
    stage.backward()
    return out.detach()


def _per_part(seq: nn.Sequential, x: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """One device as GPipe defines the step: the layers on each micro-batch in turn."""
    out = torch.cat([seq(part) for part in x.split(parts)])
    out.pow(2).mean().backward()
    return out.detach()


def _mlp(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), norm, nn.Tanh(), nn.Linear(32, 1))


@pytest.mark.parametrize(("n", "chunks", "parts"), [(12, 8, [2] * 6), (13, 4, [4, 3, 3, 3]), (5, 4, [3, 2])])
def test_a_batch_norm_model_keeps_two_samples_in_every_training_micro_batch(n, chunks, parts):
    """A batch of 12 under chunks 8 (the default 4·K for K = 2) runs as 6 micro-batches of 2, not
    2, 2, 2, 2, 1, 1, 1, 1: outputs, gradients and running statistics equal the plain layers applied
    to each 2-sample slice (BatchNorm1d raises on one sample); uneven batches keep 2 or more too."""
    seq = _mlp(nn.BatchNorm1d(32))
    reference = copy.deepcopy(seq)
    with pytest.warns(UserWarning, match="normalized by its own mean and variance"):
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
    with pytest.warns(UserWarning):
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
    with pytest.warns(UserWarning, match=r"BatchNorm layers \(1\)"):
        stage = _stage(conv, 8)
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
