"""CPU stages keep the memory they free: glibc's heap is neither trimmed nor bypassed by ``mmap``.

A CPU stage allocates and frees the same tensors every micro-batch (activations, each layer's weight
gradient before it is added into ``.grad``). glibc serves a block above its *mmap threshold* (128 KiB,
raised as such blocks are freed, up to 32 MiB) from a fresh ``mmap`` and unmaps it when freed, and
gives the top of its heap back to the system whenever more than its *trim threshold* lies free
there. Either way the pages come back zeroed and faulted in one by one at their next use: a
stage whose frees happen to leave the heap's top free re-faults tens of MiB per step, CPU time
taken from the layers on a pipeline's critical path (``docs/benchmarks.md``, ``zb_h1``).

:func:`keep_freed_memory` sets both thresholds once per process (``mallopt``), as a long-running
training process wants: a block up to :data:`MMAP_THRESHOLD` comes from the heap and a freed one
stays there for the next allocation; the process's resident memory stays at its peak. It is applied
when a fit starts on CPU, after the stage is built (setup's own peak is unchanged), and not at all
where the allocator is not glibc's or the user has set glibc's malloc settings
(``MALLOC_*_`` variables, ``GLIBC_TUNABLES``). CUDA stages are left alone: their tensors live in
PyTorch's caching allocator.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 1 << 30
"""Bytes: blocks up to this size come from the heap instead of an ``mmap`` of their own."""
TRIM_THRESHOLD = 1 << 30
"""Bytes: the heap's free top is given back to the system only beyond this size."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_kept = False  # whether this process's heap is set so


def keep_freed_memory(device: torch.device) -> bool:
    """Keep the memory this process frees in glibc's heap (module docstring) when ``device`` is a CPU.

    Returns:
        Whether the heap is set so now (``False``: not a CPU, not glibc, or the user's own settings).
    """
    global _kept
    if device.type != "cpu" or _kept:
        return _kept and device.type == "cpu"
    if platform.libc_ver()[0] != "glibc" or _user_set():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _kept = bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def _user_set() -> bool:
    """Whether the environment holds glibc malloc settings of the user's."""
    return any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )
