"""A CPU fit keeps freed memory in glibc's heap: blocks freed and allocated again fault no pages in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from lightning_gpipe.strategy import heap

_SCRIPT = """
import json, resource, sys, torch
from lightning_gpipe.strategy import heap

def faults(rounds=4):  # page faults per round of a 64 MiB block allocated, written and freed
    per = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)
        per.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(per[1:])

plain = faults()
kept = heap.keep_freed_memory(torch.device(sys.argv[1]))
print(json.dumps({"plain": plain, "kept": kept, "after": faults()}))
"""


_GLIBC = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="heap.py sets glibc's malloc only; other C libraries' allocators are left as they are",
)


def _run(device: str, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, "-c", _SCRIPT, device]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@_GLIBC
def test_freed_blocks_are_reused_without_page_faults():
    pages = (64 << 20) // 4096
    result = _run("cpu")
    assert result["plain"] > pages // 2  # glibc maps a 64 MiB block afresh each time, by default
    assert result["kept"] is True
    assert result["after"] < pages // 50  # now it comes back from the heap, its pages still there


@_GLIBC
def test_the_users_malloc_settings_and_other_devices_are_left_alone():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert _run("cpu", env)["kept"] is False
    assert heap.keep_freed_memory(torch.device("meta")) is False
