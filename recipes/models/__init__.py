"""Models for the recipes, each built as one ``nn.Sequential`` that the GPipe strategy can cut."""

from recipes.models.amoebanet import build_amoebanet
from recipes.models.transformer import build_transformer

__all__ = ["build_amoebanet", "build_transformer"]
