"""What a plan's part is in the model while pipelined: this stage's items of it, or nothing to use."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_gpipe._compat import children
from lightning_gpipe.errors import PipelineUsageError

__all__ = ["StageItems", "part_elsewhere"]


def part_elsewhere(root: str, part: str, stage: int) -> PipelineUsageError:
    """The error for using a plan's part directly while pipelined (``root``: how the model is called)."""
    return PipelineUsageError(
        f"the plan's part {part!r} was used directly (stage {stage} holds only its own items of the parts); "
        f"under plan= call the model, {root}(x), whose forward runs the parts on their stages, not the "
        "parts one by one"
    )


class StageItems(nn.Module):
    """This stage's items of a plan's ``ModuleList``/``ModuleDict`` part, under their keys (``"3"``), so
    the model's ``state_dict`` keys stay ``blocks.3....``; empty for a part on other stages. Iterating,
    indexing or calling it raises (:func:`part_elsewhere`).

    Args:
        items: ``key -> module`` of this stage.
        error: what iterating, indexing or calling raises.
    """

    error: PipelineUsageError

    def __init__(self, items: dict[str, nn.Module], error: PipelineUsageError) -> None:
        super().__init__()
        children(self).update(items)
        object.__setattr__(self, "error", error)

    def __iter__(self) -> Any:
        raise self.error

    def __getitem__(self, idx: Any) -> Any:
        raise self.error

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error
