"""Every private torch internal the package relies on, in one place.

Checked against torch 2.13.0. Each entry is tested in ``tests/test_compat.py``, so that an
upgrade that removes or renames one fails there, loudly, naming the entry, rather than deep inside
a multi-process run. Nothing else in the package touches an underscored attribute of torch; the
Lightning ones are in :mod:`lightning_gpipe._lightning`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch._C._autograd import _enable_record_function
from torch._C._autograd import _profiler_enabled as profiler_enabled
from torch._dynamo.eval_frame import OptimizedModule
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors
from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
from torch.amp import GradScaler
from torch.distributed.checkpoint._traverse import set_element as _set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MemoryFormatEncoding
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_leaves
from torch.utils._pytree import keystr as _keystr
from torch.utils._pytree import tree_flatten as _tree_flatten
from torch.utils._pytree import tree_flatten_with_path as _tree_flatten_with_path
from torch.utils._pytree import tree_unflatten as _tree_unflatten

__all__ = [
    "BatchNormBase",
    "MemoryFormatEncoding",
    "OptimizedModule",
    "StorageInfo",
    "TorchDispatchMode",
    "TreeSpec",
    "checkpoint_offset",
    "children",
    "compile_like",
    "compiled_module",
    "flatten_dense_tensors",
    "own_buffers",
    "own_parameters",
    "profiler_enabled",
    "register_state_dict_hook",
    "scaler_device",
    "scaler_optimizer_state",
    "scaler_scale",
    "set_element",
    "tree_flatten",
    "tree_leaf_paths",
    "tree_leaves",
    "tree_unflatten",
    "unflatten_dense_tensors",
    "unrecorded",
    "weights_only_globals",
]


def children(module: nn.Module) -> dict[str, Any]:
    """``module``'s children by name, repeated modules included (``named_children`` drops repeats)."""
    return module._modules


def own_parameters(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameter slots (not its children's), writable."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Any]:
    """``module``'s own buffer slots (not its children's), writable."""
    return module._buffers


def register_state_dict_hook(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``hook(module, state_dict, prefix, local_metadata)`` after ``module.state_dict()`` fills its keys."""
    return module._register_state_dict_hook(hook)


def scaler_device(scaler: GradScaler) -> str:
    """The device type a ``GradScaler`` was built for."""
    return scaler._device


def scaler_optimizer_state(scaler: GradScaler, optimizer: Optimizer) -> dict[str, Any]:
    """The scaler's per-optimizer record (``found_inf_per_device`` after ``unscale_``), writable."""
    return scaler._per_optimizer_states[id(optimizer)]


def scaler_scale(scaler: GradScaler) -> Any:
    """The scaler's current scale tensor (``None`` before its first ``scale``)."""
    return scaler._scale


def compiled_module(compiled: OptimizedModule) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles."""
    return compiled._orig_mod  # type: ignore[return-value]


def compile_like(compiled: OptimizedModule, module: nn.Module) -> nn.Module:
    """``module`` compiled with ``compiled``'s own ``torch.compile`` context (backend, mode,
    dynamic, options)."""
    return OptimizedModule(module, compiled.dynamo_ctx)


def checkpoint_offset(storage: Any) -> int | None:
    """Byte offset in the file of a storage that ``torch.load(map_location="meta")`` read (``None``:
    unknown)."""
    offset = getattr(storage, "_checkpoint_offset", None)
    return None if offset is None else int(offset)


def weights_only_globals() -> dict[str, Any]:
    """What torch's safe unpickler (``weights_only=True``) lets a file name, by ``"module.name"``: its own
    allow-list (tensors, storages, dtypes, ``torch.Size``, ``OrderedDict``, ...) and what the user added with
    ``torch.serialization.add_safe_globals`` / ``safe_globals``."""
    return {**_get_allowed_globals(), **_get_user_allowed_globals()}


def set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (a ``torch.distributed.checkpoint`` object path) in the nested ``root``."""
    _set_element(root, path, value)


def tree_flatten(value: Any) -> tuple[list[Any], TreeSpec]:
    """``value``'s leaves in order (tuple and list order, dict insertion order) and its structure
    (torch's pytree: dicts, lists, tuples, namedtuples and registered types are nodes; ``None`` and
    any other object is a leaf)."""
    return _tree_flatten(value)


def tree_unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`tree_flatten`: ``spec``'s structure holding ``leaves``."""
    return _tree_unflatten(leaves, spec)


def tree_leaf_paths(value: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``value``, paths written as indexing (``['rope'][0]``)."""
    return [(_keystr(path), leaf) for path, leaf in _tree_flatten_with_path(value)[0]]


@contextmanager
def unrecorded() -> Iterator[None]:
    """No profiler event (``RecordFunction``) is opened in this thread inside the context; on again after it.

    A Gloo ``isend`` posted while ``torch.profiler`` runs opens an event that its worker thread
    closes when the send completes. A send whose wait is deferred past the profiler's next
    ``step()`` (Lightning's ``PyTorchProfiler`` steps when a training or validation step returns)
    then writes into the event list of a cycle already freed: heap corruption, a segmentation
    fault or ``free(): invalid next size`` later in ``prepare_trace``. Sends posted here carry no
    event. (``torch._C._autograd._enable_record_function``; RecordFunction is on by default.)
    """
    _enable_record_function(False)
    try:
        yield
    finally:
        _enable_record_function(True)
