"""A checkpoint of an adapter's ``nn.Sequential`` under the original model's keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def original_state_dict(
    model: nn.Module, sequential: nn.Sequential, state_dict: Mapping[str, Any], prefix: str = ""
) -> dict[str, Any]:
    """``state_dict`` (the Sequential's keys after ``prefix``) under ``model``'s own ``state_dict`` keys.

    ``sequential`` must be the adapter built from ``model`` (they share tensors, which is how keys
    are matched). A tensor the model lists under several keys (a tied head) fills all of them.

    Args:
        prefix: where the Sequential sits in ``state_dict``, e.g. ``"layers."`` for a
            LightningModule's checkpoint whose Sequential is ``self.layers``.

    Returns:
        A dict that ``model.load_state_dict(..., strict=True)`` accepts.

    Raises:
        KeyError: a key of ``model`` has no counterpart in ``sequential`` or in ``state_dict``
            (the message names it).
    """
    by_id: dict[int, str] = {}
    for key, tensor in sequential.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), key)
    out: dict[str, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        source = by_id.get(id(tensor))
        if source is None:
            raise KeyError(
                f"{key!r} of {type(model).__name__} is not held by the Sequential; build it with adapters"
            )
        if prefix + source not in state_dict:
            raise KeyError(f"{prefix + source!r} (the model's {key!r}) is missing from the state_dict")
        out[key] = state_dict[prefix + source]
    return out
