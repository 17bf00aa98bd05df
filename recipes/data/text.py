"""Byte-level language-modelling data built at run time, with no download.

By default the corpus is the Python standard library's own ``.py`` sources (found with
``sysconfig.get_paths()["stdlib"]``), so every machine that runs the recipes has it. Bytes
are tokens (vocabulary 256), as in byte-level models such as ByT5 (Xue et al., 2022).
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes.data.recorded_shuffle import RecordedShuffle
from recipes.data.resumable_loader import ResumableLoader

__all__ = ["ByteTextDataModule", "ByteWindows", "stdlib_corpus", "unigram_entropy"]

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus(max_bytes: int) -> bytes:
    """Concatenate the standard library's ``.py`` files, in sorted path order, up to ``max_bytes``.

    Installed third-party packages (``site-packages``, ``dist-packages``) are skipped. The
    result is deterministic for a given Python installation.

    Args:
        max_bytes (int): cap on the corpus size in bytes; the last file is truncated.

    Returns:
        bytes: the corpus, at most ``max_bytes`` long.

    Raises:
        FileNotFoundError: if no standard-library source file is found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIP_DIRS]  # not walked at all
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    files = sorted(path for path in found if path.is_file())
    if not files:
        raise FileNotFoundError(f"no Python standard-library sources under {str(root)!r}")
    parts: list[bytes] = []
    size = 0
    for path in files:
        if size >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - size]
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def unigram_entropy(data: Tensor) -> float:
    """Entropy of the byte histogram of ``data``, in nats per byte.

    This is the cross entropy of the best context-free (unigram) model fitted to ``data``
    itself: a language model must go below it to have learnt anything from context.

    Args:
        data (Tensor): ``(S,)`` uint8 or int64 bytes.

    Returns:
        float: ``-sum(p * log p)`` over the 256 byte values, nats/byte.
    """
    counts = torch.bincount(data.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class ByteWindows(Dataset):
    """Fixed-length next-byte prediction windows over a byte tensor.

    Sample ``i`` starts at byte ``i * stride``: inputs are bytes ``[s, s + seq_len)`` and
    targets the same window shifted by one, ``[s + 1, s + seq_len + 1)``.

    Args:
        data (Tensor): ``(S,)`` uint8 bytes.
        seq_len (int): window length ``T`` in bytes.
        stride (int): bytes between window starts (default: ``seq_len``, no overlap).

    Shapes:
        sample: ``((T,), (T,))`` int64 input ids and target ids, values in ``[0, 256)``.
    """

    def __init__(self, data: Tensor, seq_len: int, stride: int | None = None) -> None:
        self.data = data
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.length = max(0, (len(data) - seq_len - 1) // self.stride + 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"window index out of range (index: {index}, windows: {self.length})")
        start = index * self.stride
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class ByteTextDataModule(pl.LightningDataModule):
    """Byte-level corpus split into training and validation windows.

    The corpus is the first ``max_bytes`` of the Python standard library's sources (sorted
    paths) or of the file at ``path``. The last ``val_fraction`` of its bytes is the
    validation split; the split is deterministic. Training windows are shuffled each epoch by a
    :class:`~recipes.data.resumable_loader.ResumableLoader`: a checkpoint taken mid-epoch resumes
    with the batches the uninterrupted run would have had.

    Args:
        seq_len (int): window length ``T`` in bytes (default: 64).
        batch_size (int): windows per mini-batch (default: 64).
        max_bytes (int): corpus size cap in bytes (default: 1,000,000).
        val_fraction (float): share of the bytes, taken from the end, for validation (default: 0.1).
        path (str | None): a text file to use instead of the standard library (default: None).
        num_workers (int): DataLoader workers (default: 0).

    Attributes:
        vocab_size (int): 256.

    Shapes:
        batch: ``((N, T), (N, T))`` int64 input ids and next-byte target ids.

    Raises:
        FileNotFoundError: on ``setup`` if ``path`` does not exist.
        ValueError: if a split is too short for one window.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 64,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        path: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1) (val_fraction: {val_fraction})")
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.path = path
        self.num_workers = num_workers
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None

    def _read(self) -> bytes:
        if self.path is None:
            return stdlib_corpus(self.max_bytes)
        file = Path(self.path)
        if not file.is_file():
            raise FileNotFoundError(f"text corpus file not found: {str(file)!r}")
        with file.open("rb") as handle:
            return handle.read(self.max_bytes)

    def setup(self, stage: str | None = None) -> None:
        """Read the corpus and split it (once; later calls do nothing)."""
        if self.train_data is not None:
            return
        corpus = torch.frombuffer(bytearray(self._read()), dtype=torch.uint8)
        split = len(corpus) - math.ceil(len(corpus) * self.val_fraction)
        train, val = corpus[:split], corpus[split:]
        for name, part in (("train", train), ("val", val)):
            if len(part) < self.seq_len + 1:
                raise ValueError(
                    f"{name} split shorter than one window "
                    f"({name} bytes: {len(part)}, seq_len + 1: {self.seq_len + 1})"
                )
        self.train_data, self.val_data = train, val

    @property
    def val_unigram_entropy(self) -> float:
        """Unigram entropy of the validation bytes, nats/byte (see :func:`unigram_entropy`)."""
        self.setup()
        assert self.val_data is not None
        return unigram_entropy(self.val_data)

    def train_dataset(self) -> ByteWindows:
        self.setup()
        assert self.train_data is not None
        return ByteWindows(self.train_data, self.seq_len)

    def val_dataset(self) -> ByteWindows:
        self.setup()
        assert self.val_data is not None
        return ByteWindows(self.val_data, self.seq_len)

    def train_dataloader(self) -> ResumableLoader:
        dataset = self.train_dataset()
        return ResumableLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=RecordedShuffle(dataset),  # shuffle=True's order, resumable mid-epoch
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset(), batch_size=self.batch_size, num_workers=self.num_workers)
