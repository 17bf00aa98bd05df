"""Re-materialization (GPipe section 2.3): which micro-batches recompute their forward, and how.

A recomputed micro-batch keeps only its stage input during the fill; its forward runs again
under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks in the
recompute equal those of the forward) when its backward is due. BatchNorm layers do not update
their running statistics a second time during the recompute. torchgpipe calls this module
``checkpoint.py``; here ``checkpoint=`` names the policy and saved files live in
:mod:`lightning_gpipe.state`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_gpipe._compat import BatchNormBase

__all__ = ["CHECKPOINT_MODES", "check_mode", "no_running_stats_update", "recomputed", "recomputes", "run"]

CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")
"""``"always"``: every micro-batch; ``"except_last"``: all but the last (its backward comes first,
right after its forward, so keeping its activations costs nothing extra at the peak); ``"never"``."""


def check_mode(checkpoint: str) -> str:
    """Return ``checkpoint`` if it is one of :data:`CHECKPOINT_MODES`.

    Raises:
        ValueError: any other value.
    """
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint must be one of {', '.join(repr(m) for m in CHECKPOINT_MODES)} (checkpoint: {checkpoint!r})"
        )
    return checkpoint


def recomputes(checkpoint: str, i: int, chunks: int) -> bool:
    """Whether micro-batch ``i`` of ``chunks`` is re-materialized under ``checkpoint`` (the one rule)."""
    return checkpoint == "always" or (checkpoint == "except_last" and i < chunks - 1)


def recomputed(checkpoint: str, chunks: int) -> list[bool]:
    """:func:`recomputes` for every micro-batch ``0 .. chunks-1``.

    Raises:
        ValueError: unknown ``checkpoint``.
    """
    check_mode(checkpoint)
    return [recomputes(checkpoint, i, chunks) for i in range(chunks)]


def run(
    fn: Callable[..., Any], *args: Any, context: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> Any:
    """``fn(*args)`` keeping only its inputs; the forward reruns, inside ``context()``, at backward time."""
    return torch_checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (nullcontext(), context()),
    )


@contextmanager
def no_running_stats_update(module: nn.Module) -> Iterator[None]:
    """During recompute, BatchNorm layers run exactly as in the forward, then get their running stats back.

    The recompute must save the same tensors as the forward (``torch.utils.checkpoint`` checks), so
    the layers keep tracking; their buffers are restored afterwards, which leaves one update per
    micro-batch.
    """
    saved = [
        (m, [b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None])
        for m in module.modules()
        if isinstance(m, BatchNormBase) and m.track_running_stats and m.training
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, copies in saved:
                buffers = [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
                for buf, copy in zip(buffers, copies):
                    buf.copy_(copy)
