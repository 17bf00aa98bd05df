"""``GPipeStrategy``'s collectives: every operation that needs every rank, bounded in time.

Lightning calls ``barrier``, ``broadcast``, ``reduce`` and ``reduce_boolean_decision`` on every
rank; each first waits at most ``collective_timeout`` seconds for the others to arrive
(:mod:`lightning_gpipe.transport.arrival`) and then runs on the right process group
(:mod:`lightning_gpipe.transport.groups`): metrics and losses live on the last stage, so ``reduce`` runs
over the last stage's data-parallel replicas, and what the last stage decided (metrics,
predictions, ``validate``/``test`` results) reaches every stage of its pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.utilities.types import ReduceOp
from torch import Tensor
from typing_extensions import override

from lightning_gpipe.strategy import metrics, process_group
from lightning_gpipe.transport import groups
from lightning_gpipe.transport.arrival import arrive
from lightning_gpipe.transport.layout import Layout

if TYPE_CHECKING:  # typed as the pytorch_lightning strategy they become part of
    import pytorch_lightning as pl
    from pytorch_lightning.strategies.parallel import ParallelStrategy as _Base
else:
    _Base = object

__all__ = ["Collectives"]


class Collectives(_Base):
    """The strategy's collectives (a base of ``GPipeStrategy``): barrier, broadcast, reduce, agreement,
    and sharing the last stage's outcome over its pipeline."""

    _groups: groups.Groups | None
    collective_timeout: float

    if TYPE_CHECKING:  # the strategy's own, declared for the type checker

        @property
        def layout(self) -> Layout: ...

        @property
        def root_device(self) -> torch.device: ...

    def _arrive(self, operation: str, ranks: list[int] | None = None) -> None:
        """Fail within ``collective_timeout`` seconds, naming the ranks missing, if some never reach ``operation``."""
        arrive(operation, self.collective_timeout, ranks)

    def share_last_stage_metrics(self, trainer: pl.Trainer) -> None:
        """Give every stage of each pipeline its last stage's ``trainer.callback_metrics``."""
        if self._groups is not None:
            group, layout, rank = self._groups.pipeline, self.layout, self.global_rank
            metrics.share_over_pipeline(trainer, layout, rank, group, self.root_device, self._arrive)

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """Reduce over the last stage's data-parallel replicas (where losses and metrics live)."""
        last_stage_data = self._groups.last_stage_data if self._groups is not None else None
        return process_group.reduce(tensor, group if group is not None else last_stage_data, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        groups.arrive_all("reduce_boolean_decision", self.collective_timeout)
        return groups.all_agree(decision, self.root_device, everyone=all)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        groups.arrive_all(f"barrier {name!r}" if name else "barrier", self.collective_timeout)
        groups.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        groups.arrive_all("broadcast", self.collective_timeout)
        return groups.broadcast_object(obj, src)

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` of this pipeline's last stage, on every stage of the pipeline (tensors on CPU)."""
        pipeline = self._groups.pipeline if self._groups is not None else None
        return groups.from_last_stage(obj, self.layout, self.global_rank, pipeline)

    def share_evaluation_results(self, results: Any, trainer: Any) -> Any:
        """``trainer.validate``/``test``'s return value: the last stage's, on every stage of its pipeline.

        Only the last stage logs; as under DDP, every rank returns the logged metrics.
        """
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        if getattr(fn, "value", None) not in ("validate", "test"):
            return results
        return self._from_last_stage(results)
