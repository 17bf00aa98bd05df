"""The classifier on a ViT's [CLS] token."""

from __future__ import annotations

from torch import Tensor, nn


class ClsHead(nn.Module):
    """The classifier on the first ([CLS]) token: ``(N, T, d)`` → ``(N, num_labels)``."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, hidden: Tensor) -> Tensor:
        return self.classifier(hidden[:, 0, :])
