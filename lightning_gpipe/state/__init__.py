"""Saved state: what Lightning's checkpoint hooks need from a partitioned model.

``full`` checkpoints look like the plain module's: the Sequential's ``state_dict`` gathered from
every stage (:func:`gather_sequential_state`) and one optimizer state merged from every stage
(:func:`merged_optimizer_state`, :mod:`lightning_gpipe.state.optimizer`), split back by
parameter name on load (:func:`load_optimizer_states`): the plain module loads such a file with
``strict=True``, and any number of stages loads it back. ``sharded`` checkpoints are directories
written and read by every stage itself with ``torch.distributed.checkpoint``, loadable with any
number of stages (:mod:`lightning_gpipe.state.sharded`). Both are written atomically.
torchgpipe's ``checkpoint.py`` is recompute, which lives in :mod:`lightning_gpipe.engine.recompute` here.
"""

from lightning_gpipe.errors import UnsafeCheckpointError
from lightning_gpipe.state.full import (
    FORMATS,
    broadcast_from_first_replica,
    check_format,
    gather_sequential_state,
    load_optimizer_states,
    merged_optimizer_state,
    module_state_dict,
    user_state_dict,
)
from lightning_gpipe.state.loading import load_from_checkpoint

__all__ = [
    "FORMATS",
    "UnsafeCheckpointError",
    "broadcast_from_first_replica",
    "check_format",
    "gather_sequential_state",
    "load_from_checkpoint",
    "load_optimizer_states",
    "merged_optimizer_state",
    "module_state_dict",
    "user_state_dict",
]
