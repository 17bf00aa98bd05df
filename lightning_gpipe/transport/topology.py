"""One stage's place in its pipeline: :class:`StageTopology`."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gpipe.schedule import SkipRoute

__all__ = ["StageTopology"]


@dataclass
class StageTopology:
    """Where a stage sits: its index, the stage count and the global ranks of its neighbours."""

    stage: int
    stages: int
    prev_rank: int | None
    next_rank: int | None
    ranks: tuple[int, ...] = ()  # global rank of every stage of this pipeline (for skips and the loss)
    skips: tuple[SkipRoute, ...] = ()  # skip connections of the whole pipeline

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1
