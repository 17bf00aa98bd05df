"""Lazy layers (``nn.LazyLinear``, ``nn.LazyBatchNorm2d``, ...) must have their shapes before the cut.

A lazy layer's parameters have no shape until its first forward. The stages are cut, balanced,
moved and saved from the parameters' shapes before any forward, so a module whose lazy layers were
never called fails deep inside (``ValueError: Attempted to use an uninitialized parameter``); it is
refused before any process starts instead (issue 40: a new user's everyday model).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

from lightning_gpipe.errors import PartitionError, listed

__all__ = ["check_initialized"]


def check_initialized(model: nn.Module) -> None:
    """Raise if ``model`` holds a parameter or buffer of a lazy layer not yet called.

    Raises:
        PartitionError: naming the first five such tensors and the fix (call the model once on a
            batch before ``trainer.fit``).
    """
    named = [*model.named_parameters(), *model.named_buffers()]
    lazy = [name for name, t in named if is_lazy(t)]
    if lazy:
        shown = listed(lazy)
        raise PartitionError(
            f"{type(model).__name__} holds lazy layers not yet called ({shown}: uninitialized, no shape): "
            "the gpipe strategy cuts and places the layers by their parameters before any forward. Call "
            "the model once on a batch before trainer.fit (e.g. `with torch.no_grad(): "
            "model.layers(example_batch)`), or give the layers their sizes (nn.Linear, nn.BatchNorm2d)"
        )
