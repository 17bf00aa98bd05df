"""What a transformers layer returns, reduced to its hidden state."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def first(out: Any) -> Tensor:
    """The hidden state of a layer's output: the tensor itself, or the first element of a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out
