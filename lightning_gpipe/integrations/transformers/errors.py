"""The error :func:`~lightning_gpipe.integrations.transformers.causal_lm` raises for a model it
cannot cut exactly."""

from __future__ import annotations


class UnsupportedModelError(TypeError):
    """A ``transformers`` model the adapters refuse: the message names its family, what is missing or
    differs, and the alternative (issue 39: nothing is ever silently different)."""
