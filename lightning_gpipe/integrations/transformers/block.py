"""One decoder layer of a plan-cut causal LM, with its own mask."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_gpipe.integrations.transformers.masks import layer_mask
from lightning_gpipe.integrations.transformers.outputs import first


class PlanBlock(nn.Module):
    """The model's decoder layer ``index``, called as its ``forward`` calls it.

    Input and output: the dict :class:`~lightning_gpipe.integrations.transformers.embeddings.PlanEmbeddings`
    returns, ``"hidden_states"`` replaced by the layer's output. The layer's mask (causal, sliding
    window or chunked, per ``kind``, with the padding of ``attention_mask``) is built here, on the
    stage that runs the layer, so no ``(T, T)`` table travels between stages.
    """

    def __init__(self, layer: nn.Module, kind: str, config: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.kind = kind
        self.index = index
        self.__dict__["config"] = config
        params = inspect.signature(layer.forward).parameters.values()
        self.accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.accepts = {p.name for p in params}

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        hidden = x["hidden_states"]
        kwargs: dict[str, Any] = {
            "attention_mask": layer_mask(
                self.kind, self.config, hidden, x["attention_mask"], x["position_ids"]
            ),
            "position_ids": x["position_ids"],
        }
        tables = x["position_embeddings"]
        if isinstance(tables, Mapping):
            tables = tables.get(self.kind)  # None: a layer type without rotary embedding (Beam's full layers)
        kwargs["position_embeddings"] = tables
        if not self.accepts_any:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return {**x, "hidden_states": first(self.layer(hidden, **kwargs))}
