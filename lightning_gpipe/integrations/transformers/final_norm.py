"""The modules a plan names after the decoder layers (the final norm)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class PlanNorm(nn.Module):
    """The final norm(s): the layers' dict → ``hidden_states`` normed, ``(N, T, d)``; mask and
    position tables end here."""

    def __init__(self, norms: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in norms.items():
            self.add_module(name, module)  # the model's own names: layers.3.norm.weight
        self.names = list(norms)

    def forward(self, x: dict[str, Any]) -> Tensor:
        hidden = x["hidden_states"]
        for name in self.names:
            hidden = getattr(self, name)(hidden)
        return hidden
