"""LightningDataModules for the recipes: byte-level text (also padded), scikit-learn digits, CIFAR-10."""

from recipes.data.cifar10 import CIFAR10DataModule
from recipes.data.digits import DigitsDataModule
from recipes.data.sft import ByteSFTDataModule
from recipes.data.text import ByteTextDataModule

__all__ = ["ByteSFTDataModule", "ByteTextDataModule", "CIFAR10DataModule", "DigitsDataModule"]
