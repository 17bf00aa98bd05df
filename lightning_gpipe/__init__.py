"""GPipe pipeline parallelism as a PyTorch Lightning strategy.

``import lightning_gpipe`` registers the strategy name ``"gpipe"``, so that
``Trainer(strategy="gpipe", devices=4)`` works.
"""

import importlib

from lightning_gpipe.engine import PipelineStage, aux_loss, no_chunk, take_aux_losses
from lightning_gpipe.errors import (
    MicroBatchError,
    PartitionError,
    PipelineUsageError,
    StageError,
    UnsafeCheckpointError,
)
from lightning_gpipe.schedule import Action, fill_drain, format_grid
from lightning_gpipe.state import load_from_checkpoint
from lightning_gpipe.strategy import GPipeStrategy, _namespace


def strategy_class(namespace: str = "pytorch_lightning") -> type[GPipeStrategy]:
    """The ``GPipeStrategy`` class of a Lightning namespace: ``"pytorch_lightning"`` or ``"lightning"``.

    ``GPipeStrategy`` itself works with both Trainers (an instance takes its Trainer's namespace);
    subclass this one to customise the strategy for ``import lightning as L``.
    """
    return _namespace.specialize(GPipeStrategy, namespace)


for _ns in _namespace.installed():  # "gpipe" in each installed namespace's StrategyRegistry
    strategy_class(_ns).register_strategies(
        importlib.import_module(_namespace.translate("pytorch_lightning.strategies", _ns)).StrategyRegistry
    )
_namespace.register_twins(GPipeStrategy)

__all__ = [
    "Action",
    "GPipeStrategy",
    "MicroBatchError",
    "PartitionError",
    "PipelineStage",
    "PipelineUsageError",
    "StageError",
    "UnsafeCheckpointError",
    "aux_loss",
    "fill_drain",
    "format_grid",
    "strategy_class",
    "load_from_checkpoint",
    "no_chunk",
    "take_aux_losses",
]
