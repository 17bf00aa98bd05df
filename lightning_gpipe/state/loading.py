"""Reading checkpoint files: safe by default, and only the tensors this rank needs.

Every file the package reads goes through :func:`load_structure`: torch's safe unpickler
(``torch.load(weights_only=True)``) unless the caller passes ``weights_only=False``. A file
whose pickle names anything else (a function to call, a class to build) is refused with
:class:`UnsafeCheckpointError`, which names the file and the opt-in, before any of it runs.

A full checkpoint is read in two passes. :func:`load_structure` unpickles it with
``map_location="meta"``: every tensor is a meta tensor (shape, dtype, strides) and no tensor
data is read. :class:`LazyCheckpoint` then reads the bytes of the tensors asked for, one
storage at a time, from their offset in the file (``torch.save``'s zip records are stored
uncompressed, which is what ``torch.load(mmap=True)`` relies on too). A rank thus holds at most
its own stage's tensors plus one tensor being read, never the whole model.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.migration import pl_legacy_patch
from torch import Tensor

from lightning_gpipe._compat import checkpoint_offset
from lightning_gpipe._lightning import load_module_state, migrate_checkpoint
from lightning_gpipe.errors import CheckpointError, listed
from lightning_gpipe.state.dtensors import read_shard_into, shard_like
from lightning_gpipe.state.optimizer import NAMES_KEY
from lightning_gpipe.state.unpickler import refusal

LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # torch < 1.6's file head


def safe(weights_only: bool | None) -> bool:
    """The unpickler a read uses: the safe one unless ``weights_only`` is explicitly ``False``."""
    return weights_only is not False


def check_torch_file(path: str | os.PathLike) -> None:
    """Return if ``path`` is a complete ``torch.save`` file (zip format, this machine's byte order).

    Raises:
        CheckpointError: it is empty, truncated (a zip archive without its end: an interrupted
            save or copy), written by torch < 1.6, written on a machine of the other byte order,
            or not a torch file at all; the message names the file.
    """
    name = os.fspath(path)
    with open(path, "rb") as handle:
        head = handle.read(len(LEGACY_MAGIC))
    if not head:
        raise CheckpointError(f"{name} is empty (0 bytes): the save that wrote it did not finish")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            order = [n for n in archive.namelist() if n.endswith("/byteorder")]
            if order and archive.read(order[0]).decode() != sys.byteorder:
                raise CheckpointError(
                    f"{name} was written on a {archive.read(order[0]).decode()}-endian machine "
                    f"(this one: {sys.byteorder}); load it whole with torch.load and re-save it"
                )
        return
    if head.startswith(b"PK\x03\x04"):
        raise CheckpointError(
            f"{name} is truncated: a zip archive ({os.path.getsize(path)} bytes) without its end, as an "
            "interrupted save or copy leaves it"
        )
    if head == LEGACY_MAGIC:
        raise CheckpointError(
            f"{name} is not in torch's zip format (written by torch < 1.6 or with "
            "_use_new_zipfile_serialization=False); re-save it with torch.save"
        )
    raise CheckpointError(
        f"{name} is not a checkpoint: neither a file written by torch.save nor a sharded checkpoint directory"
    )


def load_structure(
    path: str | os.PathLike | IO[bytes],
    weights_only: bool | None = None,
    map_location: Any = "meta",
    name: str | os.PathLike | None = None,
) -> Any:
    """``torch.load`` a file with the safe unpickler unless ``weights_only=False``; tensors on
    ``map_location``. Every ``torch.save`` file the package reads is read here.

    Args:
        path: the file, or an open binary file (an entry of a sharded checkpoint).
        weights_only: ``None`` or ``True``: torch's safe unpickler (tensors, containers,
            primitive types and ``torch.serialization.get_safe_globals()``); ``False``: full
            pickle, which runs whatever the file names (only for files you trust).
        map_location: ``"meta"`` (default): tensors are meta tensors and no tensor data is
            read (:class:`LazyCheckpoint` reads them); anything ``torch.load`` takes otherwise.
        name: the file in error messages (default: ``path``).

    Raises:
        UnsafeCheckpointError: the safe unpickler refuses the file; the message names the file,
            what it refused and the opt-in.
        CheckpointError: the file is not a complete ``torch.save`` file
            (:func:`check_torch_file`) or cannot be read; the message names it.
    """
    name = name if name is not None else cast(Any, path)
    if isinstance(path, (str, os.PathLike)):
        check_torch_file(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=safe(weights_only))
    except pickle.UnpicklingError as err:
        if not safe(weights_only):
            raise CheckpointError(f"{os.fspath(name)} cannot be unpickled ({err})") from err
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        reason = reason.removeprefix("WeightsUnpickler error: ").split(". ")[0].rstrip(".")
        raise refusal(name, reason) from None
    except (RuntimeError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{os.fspath(name)} is damaged: torch.load failed ({err})") from err


class LazyCheckpoint:
    """A checkpoint file whose structure is loaded and whose tensors are read on demand.

    Args:
        path: a file written by ``torch.save`` (zip format, torch ≥ 1.6).
        weights_only: see :func:`load_structure`.

    Attributes:
        path (Path): the file.
        data: the unpickled object, every tensor a meta tensor until read.

    Raises:
        UnsafeCheckpointError: see :func:`load_structure`.
        CheckpointError: the file is not a complete ``torch.save`` file (:func:`check_torch_file`),
            or holds no Lightning checkpoint (a dict with a ``state_dict``).
    """

    def __init__(self, path: str | os.PathLike, weights_only: bool | None = None) -> None:
        self.path = Path(path)
        self.data = load_structure(self.path, weights_only)
        if not isinstance(self.data, dict) or "state_dict" not in self.data:
            what = "a dict without 'state_dict'" if isinstance(self.data, dict) else type(self.data).__name__
            raise CheckpointError(f"{self.path} is not a Lightning checkpoint: it holds {what}")

    def read(self, meta: Tensor) -> Tensor:
        """The CPU tensor that ``meta`` (a tensor of :attr:`data`) stands for, read from the file."""
        if not meta.is_meta:
            return meta
        storage = meta.untyped_storage()
        offset = checkpoint_offset(storage)
        if offset is None:
            raise CheckpointError(
                f"{self.path}: torch.load gave no file offset for a tensor of shape {tuple(meta.shape)}"
            )
        raw = torch.empty(storage.nbytes(), dtype=torch.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            if handle.readinto(raw.numpy().data) != storage.nbytes():
                raise CheckpointError(
                    f"{self.path} ends before the data of a tensor of shape {tuple(meta.shape)}"
                )
        out = torch.empty(0, dtype=meta.dtype)
        out.set_(raw.untyped_storage(), meta.storage_offset(), meta.shape, meta.stride())
        return out.requires_grad_(meta.requires_grad) if meta.requires_grad else out

    def read_into(self, meta: Tensor, target: Tensor) -> None:
        """Copy the tensor that ``meta`` stands for into ``target`` (same shape).

        A contiguous CPU ``target`` of the same dtype is filled straight from the file, with no
        buffer in between; otherwise the tensor is read (:meth:`read`) and copied.
        """
        if not meta.is_meta:
            target.copy_(meta)
            return
        storage = meta.untyped_storage()
        offset = checkpoint_offset(storage)
        direct = (
            target.device.type == "cpu"
            and target.dtype == meta.dtype
            and target.is_contiguous()
            and meta.is_contiguous()
            and target.numel() > 0
        )
        if not direct or offset is None:
            target.copy_(self.read(meta))
            return
        start = int(offset) + int(meta.storage_offset()) * meta.element_size()
        view = target.detach().reshape(-1).view(torch.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(start)
            if handle.readinto(view.numpy().data) != view.numel():
                raise CheckpointError(
                    f"{self.path} ends before the data of a tensor of shape {tuple(meta.shape)}"
                )

    def materialize(self, obj: Any) -> Any:
        """``obj`` (part of :attr:`data`) with every meta tensor read (containers rebuilt, not
        changed in place)."""
        if isinstance(obj, Tensor):
            return self.read(obj)
        if isinstance(obj, Mapping):
            items = {k: self.materialize(v) for k, v in obj.items()}
            try:
                return cast(Any, type(obj))(items)
            except TypeError:
                return items
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*(self.materialize(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.materialize(v) for v in obj)
        return obj


def meta_tensors(obj: Any) -> Iterator[Tensor]:
    """Every meta tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        if obj.is_meta:
            yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from meta_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from meta_tensors(v)


def copy_into(
    target: Mapping[str, Tensor], source: Mapping[str, Tensor], read_into: Callable[[Tensor, Tensor], None]
) -> None:
    """``read_into(source[k], target[k])`` for every key of ``target``, one tensor at a time.

    Raises:
        CheckpointError: a key of ``target`` is missing from ``source``, or shapes differ.
    """
    missing = [k for k in target if k not in source]
    if missing:
        shown = listed(missing)
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensors of this stage: {shown}")
    with torch.no_grad():
        for key, tensor in target.items():
            value = source[key]
            if tuple(value.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{key}: the checkpoint's tensor has shape {tuple(value.shape)}, the module's "
                    f"{tuple(tensor.shape)}"
                )
            read_into(value, tensor)


CHECKPOINT_SOURCE = "_gpipe_checkpoint_source"  # (path, weights_only) on a module from load_from_checkpoint


def load_from_checkpoint(
    cls: type[pl.LightningModule],
    checkpoint_path: str | os.PathLike,
    *,
    weights_only: bool | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> pl.LightningModule:
    """``cls.load_from_checkpoint`` for the gpipe strategy: each rank will read only its own stage's weights.

    The module is built from the checkpoint's hyperparameters (and ``kwargs``) as Lightning's
    ``load_from_checkpoint`` builds it, but no tensor data is read: its tensors stay on the meta
    device. When a ``Trainer(strategy="gpipe")`` sets it up, each rank materializes only its
    stage's layers and reads their values from ``checkpoint_path`` (one tensor at a time).

    ``__init__`` runs under ``torch.device("meta")``, as under ``Trainer.init_module(
    empty_init=True)``: every tensor it creates is meta, and only the pipelined Sequential's are
    materialized (create other tensors, e.g. torchmetrics metrics, in ``setup``). Layers built in
    ``configure_model`` are built on the meta device at setup and read the same way.

    Args:
        cls: the LightningModule class.
        checkpoint_path: a full checkpoint file (``torch.save`` zip format).
        weights_only: ``None``/``True``: torch's safe unpickler; ``False``: full pickle (only
            for files you trust).
        strict: as for ``load_from_checkpoint`` (``None``: the module's ``strict_loading``): the
            module's keys must equal the checkpoint's; each stage's keys are checked again when read.
        **kwargs: hyperparameters overriding the checkpoint's.

    Returns:
        The module, its tensors on the meta device until the strategy sets it up.

    Raises:
        UnsafeCheckpointError: the safe unpickler refuses the file (names it and the opt-in).
        CheckpointError: the file is not in torch's zip format, or (``strict``) its keys differ
            from the module's.
    """
    with pl_legacy_patch():
        checkpoint = LazyCheckpoint(checkpoint_path, weights_only).data
    checkpoint = migrate_checkpoint(checkpoint, Path(checkpoint_path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    with torch.device(
        "meta"
    ):  # Lightning's own construction (hyperparameters, on_load_checkpoint), nothing read
        model = load_module_state(cls, checkpoint, strict=False, **kwargs)
    assert isinstance(model, pl.LightningModule)
    own = set(model.state_dict())
    if own and (
        strict if strict is not None else model.strict_loading
    ):  # else the layers come in configure_model
        saved = set(checkpoint.get("state_dict", {}))
        if own != saved:
            raise CheckpointError(
                f"{os.fspath(checkpoint_path)} does not fit {cls.__name__} (missing: "
                f"{sorted(own - saved)[:5]}, unexpected: {sorted(saved - own)[:5]}); pass strict=False to "
                "load what fits"
            )
    setattr(model, CHECKPOINT_SOURCE, (os.fspath(checkpoint_path), weights_only))
    return model


def stage_part(
    lazy: LazyCheckpoint,
    module: torch.nn.Module | None,
    plain_names: list[str] | None,
    also: Iterable[str] = (),
) -> dict[str, Any]:
    """The part of a full checkpoint a rank needs, its model and optimizer tensors not yet read.

    Model tensors that ``module`` (the partitioned LightningModule) does not hold, and the
    optimizer state of parameters it does not hold, are dropped unread; its own stay meta tensors
    until loaded (:meth:`LazyCheckpoint.read_into`, :meth:`LazyCheckpoint.materialize`);
    everything else (loops, callbacks, schedulers, optimizer hyperparameters) is read now.

    Args:
        lazy: the checkpoint.
        module: the module it loads into (``None``: keep every tensor, still unread).
        plain_names: the Sequential's parameter names in model order, for a plain one-device
            checkpoint whose optimizer state names no parameters.
        also: further parameter names whose optimizer state this rank needs (the owner's name of
            a tied parameter's copy on this stage, :mod:`lightning_gpipe.partition.tied`).
    """
    checkpoint = dict(lazy.data)
    state = checkpoint.pop("state_dict", {})
    optimizer_states = checkpoint.pop("optimizer_states", [])
    checkpoint = lazy.materialize(checkpoint)
    has_optimizer_states = "optimizer_states" in lazy.data  # a weights-only file has none: Lightning says so
    if module is None:
        if has_optimizer_states:
            checkpoint["optimizer_states"] = optimizer_states
        return {**checkpoint, "state_dict": state}
    wanted = set(module.state_dict())
    checkpoint["state_dict"] = {k: v for k, v in state.items() if k in wanted}
    mine = {name for name, _ in module.named_parameters()} | set(also)
    parts = []
    for merged in optimizer_states:
        merged = dict(merged)
        if NAMES_KEY not in merged and len(merged.get("param_groups", ())) == 1 and plain_names is not None:
            merged[NAMES_KEY] = plain_names  # a plain one-device checkpoint: one group, model order
        names = merged.get(NAMES_KEY)
        if names is not None:
            merged["state"] = {i: v for i, v in merged.get("state", {}).items() if names[i] in mine}
        parts.append({k: (v if k == "state" else lazy.materialize(v)) for k, v in merged.items()})
    if has_optimizer_states:
        checkpoint["optimizer_states"] = parts
    return checkpoint


def check_weights_only(weights_only: bool | None) -> bool | None:
    """``weights_only`` as given.

    Raises:
        ValueError: it is not ``None``, ``True`` or ``False``.
    """
    if weights_only not in (None, True, False):
        raise ValueError(f"weights_only must be None, True or False (weights_only: {weights_only!r})")
    return weights_only


def load_model_state(
    module: torch.nn.Module,
    state_dict: Mapping[str, Any],
    strict: bool,
    lazy: LazyCheckpoint | None,
    partitioned: bool,
) -> None:
    """Load a full checkpoint's ``state_dict`` into ``module`` (when ``partitioned``, only the keys it holds).

    Entries still unread (meta tensors of ``lazy``) are read one at a time straight into the module's tensors.
    """
    if partitioned:
        wanted = module.state_dict()  # a DTensor entry takes its shard of the whole tensor (tensor parallel)
        state_dict = {k: shard_like(v, wanted[k]) for k, v in state_dict.items() if k in wanted}
    if lazy is not None and any(True for _ in meta_tensors(state_dict)):
        target = module.state_dict()
        if not strict:
            target = {k: v for k, v in target.items() if k in state_dict}
        copy_into(target, state_dict, functools.partial(read_shard_into, lazy.read_into, lazy.read))
        return
    module.load_state_dict(state_dict, strict=strict)
