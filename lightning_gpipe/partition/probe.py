"""A stand-in for a plan's part while the user's forward is checked against the plan's chain."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import tree_flatten

__all__ = ["Probe"]


class Probe(nn.Module):
    """Records each call (``(name, args, kwargs, returned)`` appended to ``calls``) and returns new
    tensor objects (zeros of its first tensor input's shape, on the CPU, in the part's floating dtype, so
    that a cast the forward applies between parts is a new object too), one per output, so that where
    the forward passes a part's output on, and where it passes something else, can be told by identity.

    Args:
        name: the part's name in the model (``"blocks.3"``).
        outputs: how many values the part returns (a dict plan's outputs; 1 for a list plan).
        calls: the shared record.
        dtype: the part's parameters' floating dtype (its outputs').
    """

    def __init__(
        self, name: str, outputs: int, calls: list[tuple[str, tuple, dict, Any]], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.part, self.outputs, self.calls, self.dtype = name, outputs, calls, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        shape = leaves[0].shape if leaves else (0,)
        values = tuple(torch.zeros(shape, dtype=self.dtype) for _ in range(self.outputs))  # new objects, CPU
        out = values[0] if self.outputs == 1 else values
        self.calls.append((self.part, args, kwargs, out))
        return out
