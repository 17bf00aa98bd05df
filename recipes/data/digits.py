"""scikit-learn's bundled handwritten digits (1,797 real 8×8 images, 10 classes), no download.

The images are the UCI "Optical Recognition of Handwritten Digits" set (Alpaydin & Kaynak,
1998) shipped inside scikit-learn as ``sklearn.datasets.load_digits``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset

from recipes.data.loaders import SplitDataModule

__all__ = ["DigitsDataModule", "load_digits_tensors"]


def load_digits_tensors(resolution: int = 32, channels: int = 3) -> tuple[Tensor, Tensor]:
    """All 1,797 digits as float images in ``[0, 1]`` resized to ``resolution``.

    Args:
        resolution (int): output height and width in pixels; bilinear resize from 8×8.
        channels (int): 1 (grey) or 3 (the grey image repeated).

    Returns:
        tuple[Tensor, Tensor]: images ``(1797, channels, resolution, resolution)`` float32
        and labels ``(1797,)`` int64 in ``[0, 10)``.

    Raises:
        ValueError: if ``channels`` is not 1 or 3 or ``resolution`` is not positive.
    """
    from sklearn.datasets import load_digits

    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3 (channels: {channels})")
    if resolution < 1:
        raise ValueError(f"resolution must be positive (resolution: {resolution})")
    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
    return images.expand(-1, channels, -1, -1).contiguous(), torch.as_tensor(digits.target, dtype=torch.int64)


class DigitsDataModule(SplitDataModule):
    """Digits split into training and validation sets by a seeded permutation.

    Images are standardised with the mean and standard deviation of the training split.

    Args:
        resolution (int): image height and width in pixels (default: 32, what the five
            halvings of AmoebaNet-D need).
        channels (int): 1 or 3 image channels (default: 3).
        val_fraction (float): share of the 1,797 images held out (default: 0.2, 360 images).
        seed (int): seed of the split permutation (default: 0).
        batch_size (int): images per mini-batch (default: 64).
        num_workers (int): DataLoader workers (default: 0).

    Attributes:
        num_classes (int): 10.

    Shapes:
        batch: ``((N, channels, resolution, resolution) float32, (N,) int64)``.

    Raises:
        ValueError: if ``val_fraction`` is not in (0, 1) or ``channels`` not 1 or 3.
    """

    num_classes = 10

    def __init__(
        self,
        resolution: int = 32,
        channels: int = 3,
        val_fraction: float = 0.2,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1) (val_fraction: {val_fraction})")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3 (channels: {channels})")
        self.save_hyperparameters()
        self.resolution = resolution
        self.channels = channels
        self.val_fraction = val_fraction
        self.seed = seed
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load, split and standardise (once; later calls do nothing)."""
        if self.train_set is not None:
            return
        images, labels = load_digits_tensors(self.resolution, self.channels)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        num_val = round(len(labels) * self.val_fraction)
        train, val = order[num_val:], order[:num_val]
        mean, std = images[train].mean(), images[train].std()
        images = (images - mean) / std
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
