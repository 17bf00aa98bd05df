"""Models for the recipes, each built as one ``nn.Sequential`` that the GPipe strategy can cut
(``hf``: Hugging Face ``transformers`` models from a config, cut by
:mod:`lightning_gpipe.integrations.transformers`)."""

from recipes.models.amoebanet import build_amoebanet
from recipes.models.hf import build_hf, hf_from_checkpoint, hf_sequential
from recipes.models.transformer import build_transformer

__all__ = ["build_amoebanet", "build_hf", "build_transformer", "hf_from_checkpoint", "hf_sequential"]
