"""The Lightning glue: GPipeStrategy and what runs it (step hooks, training_step per micro-batch,
callbacks, metrics, the launcher, precision and gradients, checkpoint hooks, signals)."""

from lightning_gpipe.strategy.strategy import GPipeStrategy

__all__ = ["GPipeStrategy"]
