"""The load planner of sharded checkpoints: non-tensor entries read with torch's safe unpickler."""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from lightning_gpipe._compat import set_element
from lightning_gpipe.state.loading import load_structure
from lightning_gpipe.state.safe_reader import SafeReader

__all__ = ["SafeLoadPlanner"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with :func:`.loading.load_structure`, not
    ``torch.load(weights_only=False)``.

    Args:
        reader: the reader of the checkpoint (its ``weights_only`` and the file it reads).
        allow_partial_load: keys of the state being loaded may be missing from the checkpoint.

    Raises:
        UnsafeCheckpointError: an entry holds objects the safe unpickler refuses (the message names
            the shard file and the entry).
    """

    def __init__(self, reader: SafeReader, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        name = f"{self.reader.reading} (entry {fqn})"
        obj: Any = load_structure(value, self.reader.weights_only, map_location="cpu", name=name)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
