"""The first layer of a plan-cut causal LM: token ids (and mask) to what every decoder layer needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.integrations.transformers.parts import CausalLMParts

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def _inputs(batch: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(input_ids, attention_mask, position_ids)`` of ``batch``: ids ``(N, T)`` alone or a dict of them."""
    if isinstance(batch, Tensor):
        return batch, None, None
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"a causal_lm pipeline takes token ids (N, T) or a dict with {', '.join(INPUT_KEYS)}, "
            f"not {type(batch).__name__}"
        )
    unknown = sorted(set(batch) - set(INPUT_KEYS))
    if unknown or "input_ids" not in batch:
        raise ValueError(
            f"a causal_lm pipeline's dict input holds 'input_ids' and optionally 'attention_mask' and "
            f"'position_ids', got keys {sorted(batch)}; drop {unknown or 'nothing'}"
            + ("" if "input_ids" in batch else " and add 'input_ids'")
        )
    return batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")


class PlanEmbeddings(nn.Module):
    """Token embeddings, the family's embedding arithmetic, position ids and rotary tables.

    Input: ids ``(N, T)`` (int64), or ``{"input_ids": (N, T), "attention_mask": (N, T),
    "position_ids": (N, T) or (1, T)}`` (mask and positions optional; the mask is 1 on real tokens,
    0 on padding, left or right). Output: ``{"hidden_states": (N, T, d), "attention_mask": (N, T) or
    None, "position_ids": (N, T), "position_embeddings": (cos, sin) each (N, T, r), a dict of them by
    layer type, or None}``: every tensor has the batch dimension, so micro-batches split it.
    Position ids default to ``0 … T-1`` on every row, padding counted, as the model's ``forward``.
    """

    def __init__(self, parts: CausalLMParts) -> None:
        super().__init__()
        for name, module in [*parts.embeddings.items(), *([parts.positions] if parts.positions else [])]:
            self.add_module(name, module)  # the model's own names: layers.0.embed_tokens.weight
        self.names = list(parts.embeddings)
        self.positions = parts.positions[0] if parts.positions else None
        self.rotary = parts.rotary
        self.rotary_types = parts.rotary_types
        self.multiplier = parts.embedding_multiplier

    def forward(self, batch: Any) -> dict[str, Any]:
        ids, mask, positions = _inputs(batch)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be (N, T), got shape {tuple(ids.shape)}")
        n, t = ids.shape
        if mask is not None and tuple(mask.shape) != (n, t):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {(n, t)}, got {tuple(mask.shape)}"
            )
        if positions is None:
            positions = torch.arange(t, device=ids.device).expand(n, t)
        elif positions.dim() != 2 or positions.shape[1] != t or positions.shape[0] not in (1, n):
            raise ValueError(
                f"position_ids must be (N, T) or (1, T) = {(n, t)}, got {tuple(positions.shape)}"
            )
        else:
            positions = positions.expand(n, t)
        hidden = getattr(self, self.names[0])(ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.positions is not None:
            hidden = hidden + getattr(self, self.positions)(positions)
        for name in self.names[1:]:
            hidden = getattr(self, name)(hidden)
        tables: Any = None
        if self.rotary is not None and self.rotary_types:
            tables = {kind: self.rotary(hidden, positions, kind) for kind in self.rotary_types}
        elif self.rotary is not None:
            tables = self.rotary(hidden, positions)
        return {
            "hidden_states": hidden,
            "attention_mask": mask,
            "position_ids": positions,
            "position_embeddings": tables,
        }
