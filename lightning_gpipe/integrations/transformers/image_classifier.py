"""Hugging Face image classifiers (ResNet, ViT) as an ``nn.Sequential`` sharing their parameters."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_gpipe.integrations.transformers.cls_head import ClsHead
from lightning_gpipe.integrations.transformers.unwrap import Unwrap


def image_classifier(model: Any) -> nn.Sequential:
    """The image classifier as an ``nn.Sequential`` sharing ``model``'s parameters.

    Args:
        model: ``ResNetForImageClassification`` (``resnet.{embedder, encoder.stages, pooler}``,
            ``classifier``) or ``ViTForImageClassification`` (``vit.{embeddings, layers,
            layernorm}``, ``vit.encoder.layer`` before transformers 5, ``classifier``).

    Returns:
        ``nn.Sequential`` mapping pixels ``(N, C, H, W)`` to logits ``(N, num_labels)``.

    Raises:
        TypeError: ``model`` has neither layout.
    """
    if hasattr(model, "resnet"):
        r = model.resnet
        layers = [layer for stage in r.encoder.stages for layer in stage.layers]
        return nn.Sequential(r.embedder, *layers, r.pooler, model.classifier)
    if hasattr(model, "vit"):
        v = model.vit
        layers = v.layers if hasattr(v, "layers") else v.encoder.layer  # transformers 5 / 4
        blocks = [Unwrap(layer) for layer in layers]
        return nn.Sequential(Unwrap(v.embeddings), *blocks, v.layernorm, ClsHead(model.classifier))
    raise TypeError(
        f"image_classifier supports ResNetForImageClassification and ViTForImageClassification, not "
        f"{type(model).__name__}; build the nn.Sequential by hand for other layouts"
    )
