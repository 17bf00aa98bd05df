"""Byte-level text cut into variable-length, padded sequences: a fine-tuning (SFT) batch with masks.

Each sample is a stretch of the byte corpus of its own length, padded to ``seq_len`` on the left or
the right, with an ``attention_mask`` (1 on real tokens) and labels ``-100`` on the padding, the
layout of a Hugging Face SFT batch. It exercises the padding path of
:func:`lightning_gpipe.integrations.transformers.causal_lm` (issue 39) and the ``num_items`` loss
(docs/lightning.md, "Token-count losses").
"""

from __future__ import annotations

import hashlib

from torch import Tensor
from torch.utils.data import Dataset

from recipes.data.text import ByteTextDataModule, ByteWindows

__all__ = ["ByteSFTDataModule", "PaddedWindows"]

IGNORE = -100
PADDINGS = ("right", "left", "both")


def _draw(index: int, low: int, high: int) -> int:
    """A length in ``[low, high]`` fixed by ``index`` (a hash: the same on every rank and run)."""
    digest = hashlib.blake2b(str(index).encode(), digest_size=4).digest()
    return low + int.from_bytes(digest, "little") % (high - low + 1)


class PaddedWindows(Dataset):
    """:class:`~recipes.data.text.ByteWindows` cut to a length of their own and padded back to ``seq_len``.

    Sample ``i`` keeps the first ``L_i`` bytes of window ``i`` (``L_i`` in ``[min_len, seq_len]``,
    drawn from a hash of ``i``) and pads them with ``pad_id`` to ``seq_len``: on the right, on the
    left, or (``"both"``) on the right for even ``i`` and the left for odd ``i``.

    Args:
        windows (ByteWindows): the fixed-length windows.
        min_len (int): shortest kept length, ``1 ≤ min_len ≤ seq_len``.
        padding (str): ``"right"``, ``"left"`` or ``"both"``.
        pad_id (int): the id on padded positions of ``input_ids`` (default: 0).

    Shapes:
        sample: ``({"input_ids": (T,), "attention_mask": (T,)}, labels (T,))``, int64; labels are the
        next bytes on real tokens and ``-100`` on padding.

    Raises:
        ValueError: ``padding`` not one of the three, or ``min_len`` outside ``[1, seq_len]``.
    """

    def __init__(self, windows: ByteWindows, min_len: int, padding: str, pad_id: int = 0) -> None:
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {list(PADDINGS)} (padding: {padding!r})")
        if not 1 <= min_len <= windows.seq_len:
            raise ValueError(
                f"min_len must be in [1, seq_len] (min_len: {min_len}, seq_len: {windows.seq_len})"
            )
        self.windows = windows
        self.min_len = min_len
        self.padding = padding
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[dict[str, Tensor], Tensor]:
        ids, targets = self.windows[index]
        t = len(ids)
        keep = _draw(index, self.min_len, t)
        left = self.padding == "left" or (self.padding == "both" and index % 2 == 1)
        real = slice(t - keep, t) if left else slice(0, keep)
        out_ids = ids.new_full((t,), self.pad_id)
        labels = targets.new_full((t,), IGNORE)
        mask = ids.new_zeros(t)
        out_ids[real], labels[real], mask[real] = ids[:keep], targets[:keep], 1
        return {"input_ids": out_ids, "attention_mask": mask}, labels


class ByteSFTDataModule(ByteTextDataModule):
    """:class:`~recipes.data.text.ByteTextDataModule` with padded, variable-length samples
    (:class:`PaddedWindows`); the same corpus, split and resumable shuffling.

    Args:
        min_len (int): shortest sample in bytes (default: 16).
        padding (str): ``"right"``, ``"left"`` or ``"both"`` (alternating per sample; default).
        Others: as :class:`~recipes.data.text.ByteTextDataModule`.

    Shapes:
        batch: ``({"input_ids": (N, T), "attention_mask": (N, T)}, labels (N, T))``, int64, labels
        ``-100`` on padding.
    """

    def __init__(self, *args, min_len: int = 16, padding: str = "both", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {list(PADDINGS)} (padding: {padding!r})")
        self.min_len = min_len
        self.padding = padding

    def train_dataset(self) -> PaddedWindows:  # type: ignore[override]
        return PaddedWindows(super().train_dataset(), self.min_len, self.padding)

    def val_dataset(self) -> PaddedWindows:  # type: ignore[override]
        return PaddedWindows(super().val_dataset(), self.min_len, self.padding)
