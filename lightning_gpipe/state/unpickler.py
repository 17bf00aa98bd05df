"""Plain pickle files (a sharded checkpoint's ``.metadata``) read with an allow-list, as torch's safe
unpickler reads ``torch.save`` files.

torch's own safe unpickler (``torch.load(weights_only=True)``) refuses pickle protocol 4, which
``torch.distributed.checkpoint`` writes its ``.metadata`` with, so it cannot read that file;
:class:`RestrictedUnpickler` is Python's unpickler with ``find_class`` limited to the same
allow-list (:func:`lightning_gpipe._compat.weights_only_globals`, which includes what the user adds
with ``torch.serialization.add_safe_globals``) plus the dataclasses of the checkpoint's metadata
(:data:`METADATA_CLASSES`). Nothing else can be named, so nothing else can be called: a file that
names a function or class outside the list is refused before any of it runs
(:class:`~lightning_gpipe.errors.UnsafeCheckpointError`, the message from :func:`refusal`).
"""

from __future__ import annotations

import os
import pathlib
import pickle
from typing import IO, Any

from torch.distributed.checkpoint import metadata

from lightning_gpipe._compat import MemoryFormatEncoding, StorageInfo, weights_only_globals
from lightning_gpipe.errors import UnsafeCheckpointError

__all__ = ["METADATA_CLASSES", "OPT_IN", "RestrictedUnpickler", "refusal"]

OPT_IN = "weights_only=False"

METADATA_CLASSES: tuple[type, ...] = (
    metadata.Metadata,
    metadata.MetadataIndex,
    metadata.StorageMeta,
    metadata.TensorStorageMetadata,
    metadata.BytesStorageMetadata,
    metadata.ChunkStorageMetadata,
    metadata.TensorProperties,
    MemoryFormatEncoding,
    StorageInfo,
    pathlib.PosixPath,  # the checkpoint's path, recorded in StorageMeta
)
"""What a ``torch.distributed.checkpoint`` ``.metadata`` file names besides torch's safe globals."""


def refusal(name: str | os.PathLike, reason: str) -> UnsafeCheckpointError:
    """The error for a file that names something the safe unpickler does not allow (``reason``)."""
    return UnsafeCheckpointError(
        f"refused to load {os.fspath(name)}: torch's safe unpickler (weights_only=True) does not allow "
        f"what it holds ({reason}); if you trust this file, load it with {OPT_IN} "
        f"(GPipeStrategy({OPT_IN}) for trainer.fit/validate/test(ckpt_path=...), "
        f"lightning_gpipe.load_from_checkpoint(..., {OPT_IN})), or allow its classes with "
        "torch.serialization.add_safe_globals"
    )


class RestrictedUnpickler(pickle.Unpickler):
    """Python's unpickler that builds only allow-listed globals.

    Args:
        file: the open file (binary).
        name: the file's name in error messages.

    Raises:
        UnsafeCheckpointError: (from ``load``) the file names a global outside the allow-list, or
            a persistent id (``torch.save``'s storages: read such files with ``torch.load``).
    """

    def __init__(self, file: IO[bytes], name: str | os.PathLike) -> None:
        super().__init__(file)
        self.name = name
        self.allowed = {**weights_only_globals(), **{_full_name(c): c for c in METADATA_CLASSES}}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise refusal(self.name, f"GLOBAL {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self.name, "a persistent id")


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
