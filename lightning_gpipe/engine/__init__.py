"""One stage running its schedule column: the stage, its executor, micro-batches, recompute and skips.

Nothing here imports Lightning; the strategy drives a :class:`PipelineStage` through its step hooks.
"""

from lightning_gpipe.engine.aux_losses import aux_loss, take_aux_losses
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from lightning_gpipe.engine.microbatch import no_chunk
from lightning_gpipe.engine.recompute import recomputing
from lightning_gpipe.engine.skip import Pop, Stash
from lightning_gpipe.engine.stage import PipelineStage, StageDone

__all__ = [
    "DeferredBatchNorm",
    "PipelineStage",
    "Pop",
    "StageDone",
    "Stash",
    "aux_loss",
    "convert_deferred_batch_norm",
    "no_chunk",
    "recomputing",
    "take_aux_losses",
]
