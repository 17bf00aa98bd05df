"""A training DataLoader that a checkpoint taken mid-epoch resumes exactly (issue 41, item 6)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from recipes.data.recorded_shuffle import RecordedShuffle


class ResumableLoader(DataLoader):
    """A ``DataLoader`` with Lightning's ``state_dict``/``load_state_dict`` interface.

    Lightning saves the state of such a loader in every checkpoint (``loops.fit_loop.state_dict
    .combined_loader``) and hands it back before the resumed run's first pass. The state is the
    batches the current pass has yielded (Lightning's training loop takes batches one at a time
    from a loader with a length, so these are the batches trained on, and a checkpoint is written
    at a step boundary), the seed of the pass's order (:class:`RecordedShuffle`) or its epoch (a
    ``DistributedSampler`` Lightning added) and torch's global generator state. The resumed pass
    replays that order and skips the indices of the batches already trained on (no sample of
    theirs is loaded); torch's generator is set back to where the interrupted run had it, so the
    next pass's order, and anything else drawn from it, is the uninterrupted run's. A state
    taken at the end of a pass resumes at the start of the next.

    Args:
        *args, **kwargs: ``DataLoader``'s. Pass ``sampler=RecordedShuffle(dataset)`` for the order
            of ``shuffle=True``.

    Raises:
        ValueError: from ``load_state_dict``, for a state of another loader (more batches than a
            pass has).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0  # batches of the current pass, skipped ones included
        self._skip = 0  # batches the next pass skips
        self._skipping = 0  # _skip while the next pass's iterator is made
        self._rng: torch.Tensor | None = None  # the generator state to set at the next pass
        self._rng_before = False  # set it before the pass draws (a pass that had not begun)

    @property
    def _index_sampler(self) -> Iterable[Any]:  # what a new iterator takes its indices from (and len)
        sampler = super()._index_sampler
        return itertools.islice(iter(sampler), self._skipping, None) if self._skipping else sampler

    def __iter__(self) -> Iterator[Any]:
        if self._rng is not None and self._rng_before:
            torch.set_rng_state(self._rng)
        skipped, self._skip = self._skip, 0
        self._skipping = skipped  # only while the iterator is made: len() stays a whole pass's
        try:
            iterator = super().__iter__()  # draws its workers' base seed
        finally:
            self._skipping = 0
        if skipped and hasattr(iterator, "_index_sampler"):
            iterator._index_sampler = super()._index_sampler  # persistent workers' later passes
        if self._rng is not None and not self._rng_before:
            torch.set_rng_state(self._rng)  # where the interrupted run was, after its own draws
        self._rng = None
        return self._count(iterator, skipped)

    def _count(self, iterator: Iterator[Any], skipped: int) -> Iterator[Any]:
        self._yielded = skipped
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The current pass's position: ``batches``, ``seed``, ``epoch`` and torch's ``rng`` state."""
        sampler = self.sampler
        return {
            "batches": self._yielded,
            "seed": sampler.seed if isinstance(sampler, RecordedShuffle) else None,
            "epoch": getattr(sampler, "epoch", None),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue the one ``state`` was taken in (the next one if it had ended)."""
        batches, total = int(state["batches"]), len(self)
        if batches > total:
            raise ValueError(
                f"the loader's state is of another loader: {batches} batches taken from a pass of "
                f"{total}; resume with the data settings (batch_size, data size) of the checkpointed run"
            )
        self._rng = state["rng"]
        ended = batches in (0, total)
        self._rng_before = ended
        if ended:
            return
        self._skip = batches
        sampler = self.sampler
        if isinstance(sampler, RecordedShuffle) and state["seed"] is not None:
            sampler.replay(int(state["seed"]))
        if state["epoch"] is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(int(state["epoch"]))
