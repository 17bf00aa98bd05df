"""Re-materialization (GPipe section 2.3): which micro-batches recompute their forward, and how.

A recomputed micro-batch keeps only its stage input during the fill; its forward runs again under
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks in the recompute
equal those of the forward) when its backward is due. The recompute runs on the module state its
forward saw and changes nothing (BatchNorm running statistics, other buffers, attributes:
:mod:`lightning_gpipe.engine.effects`, which the stage applies through ``context``). torchgpipe
calls this module ``checkpoint.py``; here ``checkpoint=`` names the policy and saved files live in
:mod:`lightning_gpipe.state`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = ["CHECKPOINT_MODES", "check_mode", "recomputed", "recomputes", "run"]

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
            f"checkpoint must be one of {', '.join(repr(m) for m in CHECKPOINT_MODES)} (checkpoint: "
            f"{checkpoint!r})"
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
