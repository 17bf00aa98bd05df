"""Where every stage runs: the rank layout of pipeline × data parallelism, and one stage's place in it.

W = K × D processes run K stages in D data-parallel replicas. Replica ``d`` holds global ranks
``d·K … d·K+K-1`` and stage ``s`` of it sits on rank ``d·K + (K-1-s)``: the *last* stage is on
each pipeline's lowest rank, so global rank 0 holds the real loss and metrics, and Lightning's
rank-zero logging, progress bar and checkpoint decisions see true values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpipe.schedule import SkipRoute
from lightning_gpipe.transport.topology import StageTopology

__all__ = ["Layout", "StageTopology", "check_pipeline_parallel_size", "layer_parts", "layer_stages"]


def check_pipeline_parallel_size(size: Any) -> int | None:
    """Return ``size`` if it is ``None`` or an integer ≥ 1 (stages per pipeline).

    Raises:
        ValueError: anything else.
    """
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1 or None (got {size!r})")
    return size


@dataclass(frozen=True)
class Layout:
    """Where each (replica, stage) runs: ``rank = replica·K + (K-1-stage)``.

    Args:
        world_size: W, all processes.
        pipeline_parallel_size: K, stages per pipeline; ``W % K == 0``.

    Raises:
        ValueError: ``pipeline_parallel_size`` below 1 or not a divisor of ``world_size``.
    """

    world_size: int
    pipeline_parallel_size: int

    def __post_init__(self) -> None:
        p, w = self.pipeline_parallel_size, self.world_size
        if p < 1 or w % p:
            raise ValueError(
                f"the world size must be a multiple of pipeline_parallel_size (world size: {w}, "
                f"pipeline_parallel_size: {p}); set devices × num_nodes to a multiple of it"
            )

    @property
    def stages(self) -> int:
        return self.pipeline_parallel_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + (self.stages - 1 - stage)

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 - rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def data_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage`` in every replica (its data-parallel group)."""
        return [self.rank(d, stage) for d in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of ``replica``'s stages, in stage order."""
        return [self.rank(replica, s) for s in range(self.stages)]

    def topology(self, rank: int, skips: tuple[SkipRoute, ...] = ()) -> StageTopology:
        """Global rank ``rank``'s stage: its index, its neighbours' ranks and its pipeline's ranks."""
        stage, replica = self.stage_of(rank), self.replica_of(rank)
        ranks = tuple(self.pipeline_ranks(replica))
        return StageTopology(
            stage=stage,
            stages=self.stages,
            prev_rank=ranks[stage - 1] if stage > 0 else None,
            next_rank=ranks[stage + 1] if stage < self.stages - 1 else None,
            ranks=ranks,
            skips=tuple(skips),
        )


def layer_stages(balance: Sequence[int], stages: int | None = None) -> list[int]:
    """The stage of every layer: ``layer_stages([2, 1]) == [0, 0, 1]``.

    With ``stages`` K below ``len(balance)`` (one entry per part), part ``c``'s layers are on stage
    ``c mod K``: ``layer_stages([1, 1, 1, 1], 2) == [0, 1, 0, 1]``.
    """
    k = len(balance) if stages is None else stages
    return [c % k for c, n in enumerate(balance) for _ in range(n)]


def layer_parts(balance: Sequence[int]) -> list[int]:
    """The part of every layer (the entry of ``balance`` it belongs to):
    ``layer_parts([2, 1]) == [0, 0, 1]``."""
    return [c for c, n in enumerate(balance) for _ in range(n)]
