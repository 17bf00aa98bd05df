"""CIFAR-10 (Krizhevsky, 2009) from the standard "python version" archive; never downloads.

``root`` may be the extracted ``cifar-10-batches-py/`` directory, a directory holding it or
``cifar-10-python.tar.gz``, or the ``.tar.gz`` file itself. Get the archive from
https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz.

The batches are pickles; they are read with an unpickler that only admits the NumPy array
classes they contain, so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from recipes.data.loaders import SplitDataModule

__all__ = ["CIFAR10DataModule", "CIFAR10Images", "read_cifar10"]

ARCHIVE_NAME = "cifar-10-python.tar.gz"
BATCHES_DIR = "cifar-10-batches-py"
ARCHIVE_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCH = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"CIFAR-10 batch refers to a disallowed global: {module}.{name}")
        if module.startswith("numpy") and module != "numpy":
            return np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own _reconstruct, any numpy version
        return super().find_class(module, name)


def _load_batch(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    entry = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    data = np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(entry[b"labels"], dtype=np.int64)
    return data, labels


def _missing(root: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"CIFAR-10 not found at {str(root)!r}: expected the directory {BATCHES_DIR}/ (with "
        f"{', '.join(TRAIN_BATCHES)} and {TEST_BATCH}) or the archive {ARCHIVE_NAME}. This reader "
        f"never downloads; fetch {ARCHIVE_URL} and pass its path (or the folder holding it) as root"
    )


def _read_members(root: Path, names: list[str]) -> list[bytes]:
    """Raw bytes of the named batch files under ``root`` (directory or archive)."""
    candidates = [root / BATCHES_DIR, root] if root.is_dir() else []
    for folder in candidates:
        if all((folder / name).is_file() for name in names):
            return [(folder / name).read_bytes() for name in names]
    archive = root / ARCHIVE_NAME if root.is_dir() else root
    if archive.is_file() and tarfile.is_tarfile(archive):
        with tarfile.open(archive, "r:*") as tar:
            members = {Path(member.name).name: member for member in tar.getmembers() if member.isfile()}
            if all(name in members for name in names):
                return [tar.extractfile(members[name]).read() for name in names]  # type: ignore[union-attr]
    raise _missing(root)


def read_cifar10(root: str | Path, train: bool = True) -> tuple[Tensor, Tensor]:
    """Read the CIFAR-10 training (50,000) or test (10,000) images.

    Args:
        root (str | Path): the ``cifar-10-batches-py`` directory, a directory containing it
            or ``cifar-10-python.tar.gz``, or that archive file.
        train (bool): read ``data_batch_1..5`` (True) or ``test_batch`` (False).

    Returns:
        tuple[Tensor, Tensor]: images ``(S, 3, 32, 32)`` uint8 and labels ``(S,)`` int64.

    Raises:
        FileNotFoundError: naming ``root`` and where to get the archive, if the batches are
            not there.
        pickle.UnpicklingError: if a batch file holds anything but arrays, lists and bytes.
    """
    names = TRAIN_BATCHES if train else [TEST_BATCH]
    batches = [_load_batch(raw) for raw in _read_members(Path(root), names)]
    images = np.concatenate([data for data, _ in batches])
    labels = np.concatenate([target for _, target in batches])
    return torch.from_numpy(images), torch.from_numpy(labels)


class CIFAR10Images(Dataset):
    """Normalised CIFAR-10 images, optionally with the usual augmentation.

    Augmentation (He et al., 2016): pad 4 pixels with zeros, random 32×32 crop, random
    horizontal flip; it draws from torch's global generator.

    Args:
        images (Tensor): ``(S, 3, 32, 32)`` uint8.
        labels (Tensor): ``(S,)`` int64.
        augment (bool): apply random crop and flip (default: False).

    Shapes:
        sample: ``((3, 32, 32) float32, () int64)``.
    """

    def __init__(self, images: Tensor, labels: Tensor, augment: bool = False) -> None:
        self.images = images
        self.labels = labels
        self.augment = augment
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = (self.images[index].float() / 255.0 - self.mean) / self.std
        if self.augment:
            padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top : top + 32, left : left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, self.labels[index]


class CIFAR10DataModule(SplitDataModule):
    """CIFAR-10: the 50,000 training images for training, the 10,000 test images for validation.

    Args:
        root (str): where the archive or its extracted directory is (see :func:`read_cifar10`).
        batch_size (int): images per mini-batch (default: 128).
        augment (bool): random crop and flip on the training split (default: True).
        num_workers (int): DataLoader workers (default: 0).

    Attributes:
        num_classes (int): 10.
        channels (int): 3.
        resolution (int): 32, the images' height and width in pixels.

    Shapes:
        batch: ``((N, 3, 32, 32) float32, (N,) int64)``.

    Raises:
        FileNotFoundError: on ``setup`` if the data is not under ``root``.
    """

    num_classes = 10
    channels = 3
    resolution = 32

    def __init__(self, root: str, batch_size: int = 128, augment: bool = True, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = root
        self.batch_size = batch_size
        self.augment = augment
        self.num_workers = num_workers
        self.train_set: CIFAR10Images | None = None
        self.val_set: CIFAR10Images | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read both splits (once; later calls do nothing)."""
        if self.train_set is not None:
            return
        self.train_set = CIFAR10Images(*read_cifar10(self.root, train=True), augment=self.augment)
        self.val_set = CIFAR10Images(*read_cifar10(self.root, train=False))
