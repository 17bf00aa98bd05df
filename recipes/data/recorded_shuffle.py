"""A shuffling sampler that records the seed of each pass, so that a resumed job can replay it."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import RandomSampler


class RecordedShuffle(RandomSampler):
    """``RandomSampler(data)``'s order, with each pass's seed kept and replayable.

    Each pass draws its seed from torch's global generator when its first index is taken, as
    ``RandomSampler`` without a generator does, and permutes with a generator seeded by it: the
    same indices as ``DataLoader(shuffle=True)``. :attr:`seed` is the last pass's seed;
    :meth:`replay` makes the next pass use a given seed without drawing (the pass a checkpoint
    interrupted, see :class:`recipes.data.resumable_loader.ResumableLoader`). A subclass of
    ``RandomSampler``, so Lightning still sees a shuffled loader where it adds a
    ``DistributedSampler``.

    Args:
        data_source (Sized): what to index.

    Attributes:
        seed (int | None): the seed of the last pass begun; ``None`` before the first.
    """

    def __init__(self, data_source: Sized) -> None:
        super().__init__(data_source)
        self.seed: int | None = None
        self._replay: int | None = None

    def replay(self, seed: int) -> None:
        """Make the next pass permute with ``seed`` instead of drawing one."""
        self._replay = seed

    def __iter__(self) -> Iterator[int]:
        if self._replay is not None:
            seed, self._replay = self._replay, None
        else:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self.seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()
