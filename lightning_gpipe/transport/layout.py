"""Where every stage runs: the rank layout of pipeline × data × tensor parallelism, one stage's place in it.

W = K × D × T processes run K stages in D data-parallel replicas, each stage over T tensor-parallel
ranks. Replica ``d`` holds global ranks ``d·K·T … (d+1)·K·T-1`` and tensor-parallel rank ``t`` of
its stage ``s`` sits on rank ``(d·K + (K-1-s))·T + t``: tensor-parallel peers are adjacent ranks
(one node), a pipeline's stages next, replicas farthest apart. The *last* stage is on each
pipeline's lowest ranks, so global rank 0 holds the real loss and metrics, and Lightning's
rank-zero logging, progress bar and checkpoint decisions see true values (issue 42).
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
    """Where each (replica, stage, tensor rank) runs: ``rank = (replica·K + (K-1-stage))·T + tensor``.

    Args:
        world_size: W, all processes.
        pipeline_parallel_size: K, stages per pipeline; ``W % (K·T) == 0``.
        tensor_parallel_size: T, ranks per stage of one replica (adjacent ranks).

    Raises:
        ValueError: a size below 1, or ``K·T`` not a divisor of ``world_size``.
    """

    world_size: int
    pipeline_parallel_size: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        p, t, w = self.pipeline_parallel_size, self.tensor_parallel_size, self.world_size
        if p < 1 or t < 1 or w % (p * t):
            extra = f", tensor_parallel_size: {t}" if t != 1 else ""
            raise ValueError(
                f"the world size must be a multiple of pipeline_parallel_size × tensor_parallel_size "
                f"(world size: {w}, pipeline_parallel_size: {p}{extra}); set devices × num_nodes to a "
                f"multiple of {max(p * t, 1)}"
            )

    @property
    def stages(self) -> int:
        return self.pipeline_parallel_size

    @property
    def tensors(self) -> int:
        return self.tensor_parallel_size

    @property
    def replicas(self) -> int:
        return self.world_size // (self.pipeline_parallel_size * self.tensor_parallel_size)

    def rank(self, replica: int, stage: int, tensor: int = 0) -> int:
        return (replica * self.stages + (self.stages - 1 - stage)) * self.tensors + tensor

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 - (rank // self.tensors) % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // (self.stages * self.tensors)

    def tensor_of(self, rank: int) -> int:
        return rank % self.tensors

    def data_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """Global ranks holding ``stage`` (tensor-parallel rank ``tensor``) in every replica (its
        data-parallel group)."""
        return [self.rank(d, stage, tensor) for d in range(self.replicas)]

    def pipeline_ranks(self, replica: int, tensor: int = 0) -> list[int]:
        """Global ranks of ``replica``'s stages (tensor-parallel rank ``tensor``), in stage order."""
        return [self.rank(replica, s, tensor) for s in range(self.stages)]

    def tensor_ranks(self, replica: int, stage: int) -> list[int]:
        """Global ranks of ``replica``'s ``stage`` (its tensor-parallel group), adjacent."""
        return [self.rank(replica, stage, t) for t in range(self.tensors)]

    def mesh_ranks(self) -> list[list[list[int]]]:
        """The global rank at each coordinate ``[p][d][t]`` of the device mesh
        (``"pipeline_parallel"``, ``"data_parallel"``, ``"tensor_parallel"``).

        Every dimension runs in ascending rank order, so a coordinate is the rank in that dimension's
        process group, as ``DTensor`` assumes; along the pipeline that order runs from the last stage:
        ``stage = K-1-p``. ``Layout(4, 2).mesh_ranks() == [[[0], [2]], [[1], [3]]]``.
        """
        k = self.stages
        return [[self.tensor_ranks(d, k - 1 - p) for d in range(self.replicas)] for p in range(k)]

    def topology(self, rank: int, skips: tuple[SkipRoute, ...] = ()) -> StageTopology:
        """Global rank ``rank``'s stage: its index, its neighbours' ranks and its pipeline's ranks."""
        stage, replica = self.stage_of(rank), self.replica_of(rank)
        ranks = tuple(self.pipeline_ranks(replica, self.tensor_of(rank)))
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
