"""Deferred batch normalization: running statistics of the whole mini-batch, not of each micro-batch.

GPipe (Huang et al. 2019, section 2.2): "batch normalization ... computes the statistics over each
micro-batch during training, but accumulates the mini-batch statistics for evaluation". A plain
BatchNorm run on ``M`` micro-batches instead makes ``M`` momentum updates of its running statistics,
each from a small micro-batch, so its evaluation-time statistics differ from those of the same model
trained without the pipeline. The idea follows torchgpipe's ``DeferredBatchNorm``
(``torchgpipe/batchnorm.py``); the code is ours.

:class:`DeferredBatchNorm` normalises each micro-batch with that micro-batch's own statistics (as a
plain BatchNorm does in training) and only accumulates, per channel, the sum and the sum of squares
of its inputs; :meth:`DeferredBatchNorm.commit` then makes one running-statistics update from the
whole mini-batch, as a plain BatchNorm called once on the whole mini-batch would.

Recompute (``torch.utils.checkpoint``) runs a micro-batch's forward a second time; wrap it in
:func:`no_accumulate` so that the micro-batch is counted once::

    with no_accumulate():
        recompute()                         # normalises, does not accumulate

    commit_deferred_batch_norm(model)       # once per mini-batch, after its forward
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_gpipe._compat import BatchNormBase

__all__ = [
    "DeferredBatchNorm",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "is_accumulating",
    "no_accumulate",
]

_switch = threading.local()


@contextmanager
def no_accumulate() -> Iterator[None]:
    """Within this context, :class:`DeferredBatchNorm` forwards of this thread do not accumulate.

    For recompute: the re-run forward of a checkpointed micro-batch normalises as before but must not
    count the micro-batch a second time. The switch is thread-local (recompute runs in the thread
    that enters the context, which under autograd may be a backward thread) and nests.
    """
    previous = getattr(_switch, "off", False)
    _switch.off = True
    try:
        yield
    finally:
        _switch.off = previous


def is_accumulating() -> bool:
    """Whether :class:`DeferredBatchNorm` forwards of this thread accumulate (no :func:`no_accumulate`)."""
    return not getattr(_switch, "off", False)


class DeferredBatchNorm(BatchNormBase):
    """BatchNorm that updates its running statistics once per mini-batch, from all its micro-batches.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance when normalising (default: 1e-5).
        momentum: weight of the mini-batch's statistics in the running ones, or ``None`` for a
            cumulative average over ``num_batches_tracked`` mini-batches (default: 0.1).
        affine: whether to learn a per-channel ``weight`` and ``bias`` (default: True).
        track_running_stats: without running statistics the module is a plain BatchNorm that
            always uses batch statistics and has nothing to defer (default: True).
        device, dtype: of the parameters and buffers.

    Shapes: input ``(N, C)`` or ``(N, C, *)`` (as BatchNorm1d, 2d and 3d take), output the same;
    statistics are per channel, over every dimension but ``C``.

    In training, ``forward`` normalises with the input's own statistics (the output equals a plain
    BatchNorm's) and adds the input's per-channel sum and sum of squares (float64, detached) and
    element count to accumulators, unless inside :func:`no_accumulate`. :meth:`commit` updates
    ``running_mean``, ``running_var`` (unbiased variance, as ``F.batch_norm`` does) and
    ``num_batches_tracked`` once from the accumulated elements and clears the accumulators. In
    evaluation it is a plain BatchNorm. The accumulators are plain attributes, not in ``state_dict``:
    its keys are a plain BatchNorm's. Each data-parallel replica accumulates only its own inputs, as
    a plain (not synchronised) BatchNorm does.

    Raises:
        ValueError: (forward) the input has fewer than 2 dimensions.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._sum: Tensor | None = None  # (C,) float64: sum of the accumulated inputs
        self._sum_of_squares: Tensor | None = None  # (C,) float64
        self._count = 0  # accumulated elements per channel

    def _check_input_dim(self, input: Tensor) -> None:  # noqa: A002 - _BatchNorm's name
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C) or (N, C, *) (got {input.dim()}D input)")

    @property
    def accumulated(self) -> int:
        """Elements per channel accumulated since the last :meth:`commit` (0: nothing to commit)."""
        return self._count

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - _BatchNorm's name
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if is_accumulating():
            self._accumulate(input)
        return output

    def _accumulate(self, input: Tensor) -> None:  # noqa: A002
        with torch.no_grad():
            x = input.detach()
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()  # half-precision statistics would lose digits
            dims = [0, *range(2, x.dim())]
            count = x.numel() // x.shape[1]
            # Per-micro-batch mean and variance are stable in the input's precision; summed in float64.
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            acc_dtype = torch.float32 if x.device.type == "mps" else torch.float64
            mean, var = mean.to(acc_dtype), var.to(acc_dtype)
            total, squares = mean * count, (var + mean * mean) * count
            if self._sum is None or self._sum_of_squares is None:
                self._sum, self._sum_of_squares = total, squares
            else:
                self._sum = self._sum.to(total.device) + total
                self._sum_of_squares = self._sum_of_squares.to(squares.device) + squares
            self._count += count

    def commit(self) -> None:
        """Update the running statistics once from the accumulated mini-batch and clear the accumulators.

        With ``n`` accumulated elements per channel of mean ``m`` and biased variance ``v``:
        ``running_mean = (1 - f) * running_mean + f * m`` and
        ``running_var = (1 - f) * running_var + f * v * n / (n - 1)``, where ``f`` is ``momentum``
        or, when ``momentum`` is ``None``, ``1 / num_batches_tracked`` after its increment by one.
        A no-op when nothing was accumulated.
        """
        total, squares, n = self._sum, self._sum_of_squares, self._count
        self._discard()
        if total is None or squares is None or n == 0:
            return
        if self.running_mean is None or self.running_var is None:
            return
        with torch.no_grad():
            mean = total / n
            var = (squares / n - mean * mean).clamp_(min=0.0) * (n / max(n - 1, 1))
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            if self.momentum is None:
                assert self.num_batches_tracked is not None
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            for running, batch in ((self.running_mean, mean), (self.running_var, var)):
                batch = batch.to(device=running.device, dtype=running.dtype)
                running.mul_(1.0 - factor).add_(batch, alpha=factor)

    def _discard(self) -> None:
        self._sum = self._sum_of_squares = None
        self._count = 0

    def reset_running_stats(self) -> None:
        """Reset the running statistics (as BatchNorm does) and drop anything accumulated."""
        super().reset_running_stats()
        if hasattr(self, "_count"):  # _NormBase.__init__ calls this before our __init__ sets it
            self._discard()


_CONVERTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d that tracks running statistics by a :class:`DeferredBatchNorm`.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm``: containers are converted in place and
    returned; a BatchNorm ``module`` itself is returned converted. The new layers keep the same
    ``num_features``, ``eps``, ``momentum``, ``affine``, training mode, and the very same
    ``weight``/``bias`` Parameters and ``running_mean``/``running_var``/``num_batches_tracked``
    buffers (shared, not copied: deep-copy first to keep the original model apart), so
    ``state_dict`` keys and values are unchanged and load strictly into the plain model.
    SyncBatchNorm, lazy and non-tracking BatchNorms are left as they are.

    Args:
        module: a model, or a single BatchNorm.

    Returns:
        ``module`` with its BatchNorms converted, or the converted BatchNorm.
    """
    if isinstance(module, _CONVERTED) and module.track_running_stats:
        deferred = DeferredBatchNorm(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=True,
            device=module.running_mean.device if module.running_mean is not None else None,
            dtype=module.running_mean.dtype if module.running_mean is not None else None,
        )
        if module.affine:
            deferred.weight, deferred.bias = module.weight, module.bias
        deferred.running_mean = module.running_mean
        deferred.running_var = module.running_var
        deferred.num_batches_tracked = module.num_batches_tracked
        deferred.train(module.training)
        return deferred
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child)
        if converted is not child:
            module.add_module(name, converted)
    return module


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Call :meth:`DeferredBatchNorm.commit` on every DeferredBatchNorm in ``module``.

    Call once per mini-batch after its forward (e.g. before the optimizer step); a no-op for layers
    that accumulated nothing (evaluation, or no DeferredBatchNorm at all).
    """
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()


def defer_batch_norms(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """:func:`convert_deferred_batch_norm` on ``module``, returning ``(owner, name, original)`` of each
    tracking BatchNorm for :func:`restore_batch_norms`."""
    originals: list[tuple[nn.Module, str, nn.Module]] = [
        (owner, name, child)
        for owner in module.modules()
        for name, child in owner.named_children()
        if isinstance(child, BatchNormBase) and child.track_running_stats
    ]
    convert_deferred_batch_norm(module)  # shares parameters and buffers with the originals
    return originals


def restore_batch_norms(originals: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo :func:`defer_batch_norms`: put the original BatchNorm layers back."""
    for owner, name, child in originals:
        setattr(owner, name, child)
