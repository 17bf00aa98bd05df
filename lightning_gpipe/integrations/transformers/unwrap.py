"""A transformers layer called on the hidden state alone."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_gpipe.integrations.transformers.outputs import first


class Unwrap(nn.Module):
    """A layer called on the hidden state alone, its first output kept: ``(N, *)`` → ``(N, *)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor) -> Tensor:
        return first(self.layer(hidden))
