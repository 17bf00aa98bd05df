"""Cutting the user's ``nn.Sequential`` into stages (:mod:`~lightning_gpipe.partition.cut`), tied weights
across stages, and one rank's stage."""

from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.partition.tied import find_tied

__all__ = [
    "build_stage",
    "find_tied",
]
