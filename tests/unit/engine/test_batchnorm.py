"""DeferredBatchNorm: micro-batches normalised on their own, running statistics as for the whole
mini-batch."""

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.batchnorm import (
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    is_accumulating,
    no_accumulate,
)

BN_KEYS = ("running_mean", "running_var", "num_batches_tracked")


def conv_bn_model(momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum),
    )


def deferred_copy(model: nn.Module) -> nn.Module:
    return convert_deferred_batch_norm(copy.deepcopy(model))


def assert_same_running_stats(deferred: nn.Module, plain: nn.Module, prefix: str = "") -> None:
    plain_state = plain.state_dict()
    for key, value in deferred.state_dict().items():
        if key.startswith(prefix) and key.rsplit(".", 1)[-1] in BN_KEYS:
            torch.testing.assert_close(value, plain_state[key], atol=1e-5, rtol=1e-5, msg=key)


def step_both(deferred: nn.Module, reference: nn.Module, x: torch.Tensor, chunks: int = 4) -> None:
    """One mini-batch: ``deferred`` on ``chunks`` micro-batches, then commit; each plain BatchNorm of
    ``reference`` once on the concatenated micro-batch inputs of its deferred twin (its running stats
    are then what GPipe's should be: a later BatchNorm sees micro-batch-normalised inputs)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, m in deferred.named_modules():
        if isinstance(m, DeferredBatchNorm):
            inputs = seen.setdefault(name, [])
            hooks.append(m.register_forward_pre_hook(lambda _m, args, inputs=inputs: inputs.append(args[0])))
    with torch.no_grad():
        for chunk in x.chunk(chunks):
            deferred(chunk)
        for hook in hooks:
            hook.remove()
        commit_deferred_batch_norm(deferred)
        layers = dict(reference.named_modules())
        for name, inputs in seen.items():
            layers[name](torch.cat(inputs))


def test_micro_batches_commit_the_whole_batch_statistics():
    plain = conv_bn_model()
    deferred, reference = deferred_copy(plain), copy.deepcopy(plain)
    x = torch.randn(16, 3, 6, 6) * 3 + 1
    with torch.no_grad():
        plain(x)  # the whole batch of 16 in one call
        for chunk in x.chunk(4):
            deferred(chunk)
    assert all(m.num_batches_tracked == 0 for m in deferred.modules() if isinstance(m, DeferredBatchNorm))
    assert all(
        m.running_mean.abs().sum() == 0 for m in deferred.modules() if isinstance(m, DeferredBatchNorm)
    )
    commit_deferred_batch_norm(deferred)
    assert all(m.num_batches_tracked == 1 for m in deferred.modules() if isinstance(m, DeferredBatchNorm))
    assert_same_running_stats(deferred, plain, prefix="1.")  # the first BN sees the same conv outputs
    deferred = deferred_copy(conv_bn_model())
    step_both(deferred, reference, x)
    assert_same_running_stats(deferred, reference)  # every BN, the second one included


def test_micro_batch_outputs_and_gradients_equal_plain_batch_norm_per_micro_batch():
    plain = conv_bn_model()
    deferred = deferred_copy(plain)
    x = torch.randn(16, 3, 6, 6)
    for chunk in x.chunk(4):
        expected, got = plain(chunk), deferred(chunk)
        torch.testing.assert_close(got, expected)
        expected.sum().backward()
        got.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_cumulative_momentum_over_three_mini_batches_equals_plain_model():
    plain = conv_bn_model(momentum=None)
    deferred, reference = deferred_copy(plain), copy.deepcopy(plain)
    for step in range(3):
        x = torch.randn(16, 3, 6, 6) * (step + 1) + step
        with torch.no_grad():
            plain(x)
        step_both(deferred, reference, x)
    assert_same_running_stats(deferred, plain, prefix="1.")
    assert_same_running_stats(deferred, reference)
    assert deferred[1].num_batches_tracked == 3 and deferred[4].num_batches_tracked == 3


def test_uneven_micro_batches_weigh_by_element_count():
    plain, deferred = nn.BatchNorm2d(3), DeferredBatchNorm(3)
    x = torch.randn(10, 3, 4, 4) + 2
    with torch.no_grad():
        plain(x)
        for chunk in x.split([4, 3, 2, 1]):
            deferred(chunk)
    assert deferred.accumulated == 10 * 4 * 4
    deferred.commit()
    assert deferred.accumulated == 0
    assert_same_running_stats(deferred, plain)


def test_eval_mode_equals_plain_eval():
    plain = conv_bn_model()
    deferred, reference = deferred_copy(plain), copy.deepcopy(plain)
    step_both(deferred, reference, torch.randn(16, 3, 6, 6))
    reference.eval()
    deferred.eval()
    y = torch.randn(5, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(deferred(y), reference(y), atol=1e-5, rtol=1e-5)
    assert deferred[1].accumulated == 0


def test_state_dict_keys_are_plain_and_load_strictly_into_the_plain_model():
    plain = conv_bn_model()
    deferred = deferred_copy(plain)
    assert isinstance(deferred[1], DeferredBatchNorm) and isinstance(deferred[4], DeferredBatchNorm)
    with torch.no_grad():
        deferred(torch.randn(4, 3, 6, 6))  # accumulators filled: still not in the state_dict
    assert list(deferred.state_dict()) == list(plain.state_dict())
    commit_deferred_batch_norm(deferred)
    fresh = conv_bn_model()
    fresh.load_state_dict(deferred.state_dict(), strict=True)
    assert_same_running_stats(fresh, deferred)
    deferred.load_state_dict(plain.state_dict(), strict=True)


def test_conversion_keeps_settings_parameters_and_buffers():
    bn = nn.BatchNorm1d(6, eps=1e-3, momentum=0.3, affine=True)
    bn.eval()
    converted = convert_deferred_batch_norm(bn)
    assert isinstance(converted, DeferredBatchNorm)
    assert (converted.num_features, converted.eps, converted.momentum) == (6, 1e-3, 0.3)
    assert converted.weight is bn.weight and converted.bias is bn.bias
    assert converted.running_mean is bn.running_mean and not converted.training
    no_affine = convert_deferred_batch_norm(nn.BatchNorm3d(2, affine=False))
    assert isinstance(no_affine, DeferredBatchNorm) and no_affine.weight is None
    untracked = nn.BatchNorm2d(2, track_running_stats=False)
    assert convert_deferred_batch_norm(untracked) is untracked
    nested = nn.Sequential(nn.Sequential(nn.BatchNorm2d(2)), nn.SyncBatchNorm(2))
    assert convert_deferred_batch_norm(nested) is nested
    assert isinstance(nested[0][0], DeferredBatchNorm) and type(nested[1]) is nn.SyncBatchNorm


def test_no_accumulate_skips_accumulation_and_nests():
    deferred = DeferredBatchNorm(3)
    x = torch.randn(8, 3)
    assert is_accumulating()
    with no_accumulate():
        with no_accumulate():
            pass
        assert not is_accumulating()
        y = deferred(x)
    assert is_accumulating()
    assert deferred.accumulated == 0
    torch.testing.assert_close(y, nn.BatchNorm1d(3)(x))
    deferred.commit()  # nothing accumulated: no update
    assert deferred.num_batches_tracked == 0 and torch.equal(deferred.running_mean, torch.zeros(3))


def test_recompute_under_no_accumulate_counts_each_micro_batch_once():
    plain = conv_bn_model()
    deferred, reference = deferred_copy(plain), deferred_copy(plain)
    x = torch.randn(8, 3, 6, 6)
    for i, chunk in enumerate(x.chunk(2)):
        y = torch.utils.checkpoint.checkpoint(
            deferred,
            chunk.requires_grad_(),
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), no_accumulate()),
        )
        y.sum().backward()  # recomputes the forward under no_accumulate()
        assert deferred[1].accumulated == (i + 1) * 4 * 6 * 6
        with torch.no_grad():
            reference(chunk)
    commit_deferred_batch_norm(deferred)
    commit_deferred_batch_norm(reference)
    assert deferred[1].num_batches_tracked == 1
    assert_same_running_stats(deferred, reference)


def _plain_on_batch_deferred_on_chunks(plain: nn.Module, deferred: nn.Module, x: torch.Tensor) -> None:
    """Run ``plain`` on the whole batch and ``deferred`` on its 4 micro-batches, then commit."""
    with torch.no_grad():
        plain(x)
        for chunk in x.chunk(4):
            deferred(chunk)
    commit_deferred_batch_norm(deferred)


@pytest.mark.parametrize("shape", [(16, 5), (16, 5, 7)], ids=["NC", "NCL"])
def test_batch_norm_1d_inputs(shape):
    plain = nn.BatchNorm1d(5, momentum=0.2)
    deferred = convert_deferred_batch_norm(copy.deepcopy(plain))
    _plain_on_batch_deferred_on_chunks(plain, deferred, torch.randn(*shape) * 2 - 1)
    assert_same_running_stats(deferred, plain)
    with pytest.raises(ValueError, match="got 1D input"):
        deferred(torch.randn(5))


def test_batch_norm_3d_inputs():
    plain = nn.BatchNorm3d(2)
    deferred = convert_deferred_batch_norm(copy.deepcopy(plain))
    _plain_on_batch_deferred_on_chunks(plain, deferred, torch.randn(8, 2, 3, 3, 3) + 5)
    assert_same_running_stats(deferred, plain)


def test_bfloat16_inputs_accumulate_in_full_precision():
    x = (torch.randn(16, 3, 4, 4) * 0.5 + 100).bfloat16()
    plain = nn.BatchNorm2d(3)
    deferred = DeferredBatchNorm(3, dtype=torch.bfloat16)
    with torch.no_grad():
        plain(x.float())
        for chunk in x.chunk(4):
            deferred(chunk)
    deferred.commit()
    assert deferred.running_mean.dtype == torch.bfloat16
    torch.testing.assert_close(deferred.running_mean.float(), plain.running_mean, atol=0.1, rtol=1e-2)
    torch.testing.assert_close(deferred.running_var.float(), plain.running_var, atol=1e-2, rtol=2e-2)
