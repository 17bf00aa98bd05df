"""Sharded checkpoints read with nothing unpickled outside the allow-list, and every failure naming its file.

``torch.distributed.checkpoint``'s ``FileSystemReader`` unpickles ``.metadata`` with plain pickle,
and its default load planner reads non-tensor entries with ``torch.load(weights_only=False)``:
either runs whatever a crafted file names. :class:`SafeReader` reads ``.metadata`` with
:class:`~lightning_gpipe.state.unpickler.RestrictedUnpickler` and reads the shard files one at a
time, so that a refused, truncated or damaged one is named; non-tensor entries are read by
:class:`~lightning_gpipe.state.safe_planner.SafeLoadPlanner` (tensor entries torch already reads
with ``weights_only=True``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from lightning_gpipe.errors import CheckpointError, UnsafeCheckpointError
from lightning_gpipe.state.unpickler import RestrictedUnpickler, refusal

__all__ = ["METADATA_FILE", "SafeReader"]

METADATA_FILE = ".metadata"


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that reads ``.metadata`` with an allow-list and names every file it fails on.

    Args:
        path: the checkpoint directory.
        weights_only: ``None``/``True``: the allow-list (:mod:`lightning_gpipe.state.unpickler`)
            for ``.metadata`` and torch's safe unpickler for non-tensor entries; ``False``: full
            pickle (only for files you trust).

    Attributes:
        reading (Path): the file being read (the directory before any).

    Raises:
        UnsafeCheckpointError: a file names a global outside the allow-list (the message names it).
        CheckpointError: ``.metadata`` is missing, damaged or no checkpoint metadata, or a shard
            file is truncated or damaged (the message names the file).
    """

    def __init__(self, path: str | os.PathLike, weights_only: bool | None = None) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self.reading = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``.metadata``, read once (every rank reads it before any collective)."""
        if self._metadata is None:
            self._metadata = self._read_metadata(Path(self.path) / METADATA_FILE)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_metadata(self, path: Path) -> Metadata:
        if not path.is_file():
            raise CheckpointError(
                f"{path.parent} has no {METADATA_FILE}: not a complete torch.distributed.checkpoint directory"
            )
        self.reading = path
        with open(path, "rb") as handle:
            try:
                if self.weights_only is False:
                    metadata = pickle.load(handle)  # the user's opt-in: a file they trust
                else:
                    metadata = RestrictedUnpickler(handle, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{path} is damaged: it cannot be unpickled ({err!r})") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds {type(metadata).__name__}, not checkpoint metadata")
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items one shard file at a time (:attr:`reading`)."""
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in by_file.items():
            self.reading = Path(self.path) / relative
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except pickle.UnpicklingError as err:
                raise refusal(self.reading, str(err).splitlines()[0] if str(err) else "") from None
            except Exception as err:
                raise CheckpointError(
                    f"{self.reading} is truncated or damaged: reading it failed ({err!r})"
                ) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done
