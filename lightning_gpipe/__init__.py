"""GPipe pipeline parallelism as a PyTorch Lightning strategy.

``import lightning_gpipe`` registers the strategy name ``"gpipe"``, so that
``Trainer(strategy="gpipe", devices=4)`` works.
"""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_gpipe.failure import StageError
from lightning_gpipe.partition import PartitionError
from lightning_gpipe.schedule import Action, fill_drain, format_grid
from lightning_gpipe.stage import PipelineStage, PipelineUsageError
from lightning_gpipe.strategy import GPipeStrategy

GPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Action",
    "GPipeStrategy",
    "PartitionError",
    "PipelineStage",
    "PipelineUsageError",
    "StageError",
    "fill_drain",
    "format_grid",
]
