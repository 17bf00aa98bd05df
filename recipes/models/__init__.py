"""Models for the recipes, each built as one ``nn.Sequential`` that the GPipe strategy can cut.
:mod:`recipes.models.hf` (Hugging Face ``transformers`` models from a config, cut by
:mod:`lightning_gpipe.integrations.transformers`) needs the ``[models]`` extra and is imported
from there, not here."""

from recipes.models.amoebanet import build_amoebanet
from recipes.models.transformer import build_transformer

__all__ = ["build_amoebanet", "build_transformer"]
