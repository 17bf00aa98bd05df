"""Where the CPU goes in ours' turns and in the peer's, per thread, from ``perf`` samples.

A run of :mod:`benchmarks.worker` with ``alternate=true`` records, on each rank, the windows of
its timed steps (``turn_windows``: ``{"ours": [[start, end], …], "peer": […]}``, seconds of
``CLOCK_MONOTONIC``, which ``time.perf_counter`` reads on Linux). Recorded under
``perf record -k CLOCK_MONOTONIC``, every sample of both processes falls into a window of ours, a
window of the peer, or neither (the untimed first step of each turn, start-up). This script sums
the samples per window kind and thread, divides by the number of timed steps of that kind, and
prints, per process and thread:

- for ``cpu-clock`` (or ``cycles``) samples: milliseconds of CPU per step, by where the sample
  landed (the sgemm kernels, the Python interpreter, the rest of ``libtorch_cpu``, the kernel,
  libc, other);
- for tracepoints (``-e syscalls:sys_enter_epoll_wait`` …): events per step (``#epoll_wait``).

Usage, from the repository root (``mode=spec`` writes the spec the benchmark would hand its
worker, and the worker writes its results beside it)::

    python -m benchmarks.benchmark mode=spec schedule=1f1b chunks=8 warmup=4 memory=false \
        alternate=true block=4 timed=160 'runs=[ours]' spec=/tmp/gpipe-perf/ours.json
    perf record -k CLOCK_MONOTONIC -F 999 -e cpu-clock -o perf.data -- \
        python -m benchmarks.worker /tmp/gpipe-perf/ours.json
    python -m benchmarks.perf_turns /tmp/gpipe-perf/ours_rank0.json perf.data

The windows come from rank 0; the ranks take their turns together, so rank 1's steps fall in
the same windows to within the pipeline's skew of a few milliseconds.
"""

from __future__ import annotations

import bisect
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Sample", "category", "main", "parse", "per_step"]

_LINE = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>\d+\.\d+):\s+(?P<period>\d+)\s+"
    r"(?P<event>\S+?):\s*(?:[0-9a-f]+\s+(?P<sym>.*?)\s+\((?P<dso>[^()]*)\))?\s*$"
)
FIELDS = "comm,pid,tid,time,period,event,ip,sym,dso"
"""The ``perf script -F`` fields :func:`parse` reads."""


@dataclass(frozen=True)
class Sample:
    """One ``perf script`` line: ``period`` is nanoseconds of CPU for ``cpu-clock``, 1 for a tracepoint."""

    comm: str
    pid: int
    tid: int
    time: float
    period: int
    event: str
    sym: str
    dso: str


def parse(lines: Iterable[str]) -> list[Sample]:
    """The samples of ``perf script -F`` :data:`FIELDS` output (lines that do not match are skipped)."""
    out = []
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        out.append(
            Sample(
                m["comm"].strip(),
                int(m["pid"]),
                int(m["tid"]),
                float(m["time"]),
                int(m["period"]),
                m["event"],
                m["sym"] or "",
                (m["dso"] or "").rsplit("/", 1)[-1],
            )
        )
    return out


def category(sym: str, dso: str) -> str:
    """Where a CPU sample landed: ``gemm`` (any sgemm/dgemm kernel), ``python``, ``torch`` (the
    rest of libtorch), ``kernel``, ``libc`` or ``other``."""
    if "gemm" in sym.lower():
        return "gemm"
    if dso.startswith("libpython") or dso.startswith("perf-"):
        return "python"
    if dso.startswith("libtorch") or dso.startswith("libc10"):
        return "torch"
    if "kernel" in dso:
        return "kernel"
    if dso.startswith("libc.so") or dso.startswith("libc-"):
        return "libc"
    return "other"


def per_step(
    samples: Iterable[Sample], windows: dict[str, list[list[float]]]
) -> dict[tuple[str, int, int, str], Counter[str]]:
    """Per (window kind, pid, tid, thread name): what its samples in the windows of that kind add up
    to, per timed step of that kind. CPU samples count milliseconds under their :func:`category`;
    tracepoint events count events under ``"#"`` and the event's name (its ``sys_enter_`` prefix
    dropped), e.g. ``"#epoll_wait"``."""
    marks = sorted((a, b, kind) for kind, spans in windows.items() for a, b in spans)
    starts = [a for a, _, _ in marks]
    steps = {kind: max(1, len(spans)) for kind, spans in windows.items()}
    out: dict[tuple[str, int, int, str], Counter[str]] = defaultdict(Counter)
    for s in samples:
        i = bisect.bisect_right(starts, s.time) - 1
        if i < 0 or s.time > marks[i][1]:
            continue
        kind = marks[i][2]
        comm = "main" if s.pid == s.tid else s.comm
        if s.event.startswith(("cpu-clock", "task-clock", "cycles")):
            out[(kind, s.pid, s.tid, comm)][category(s.sym, s.dso)] += s.period / 1e6 / steps[kind]
        else:
            name = "#" + s.event.split(":")[-1].replace("sys_enter_", "")
            out[(kind, s.pid, s.tid, comm)][name] += 1 / steps[kind]
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: python -m benchmarks.perf_turns OURS_RANK0.json PERF.DATA")
    windows = json.loads(open(argv[1]).read()).get("turn_windows")
    if not windows:
        raise SystemExit(f"{argv[1]} holds no turn_windows: run the worker with alternate=true")
    text = subprocess.run(
        ["perf", "script", "-i", argv[2], "-F", FIELDS], capture_output=True, text=True, check=True
    ).stdout
    table = per_step(parse(text.splitlines()), windows)
    threads = sorted(
        {(pid, tid, comm) for _, pid, tid, comm in table}, key=lambda t: (t[0], t[2] != "main", t[1])
    )
    print(f"timed steps: ours {len(windows['ours'])}, peer {len(windows['peer'])}; per step:")
    for pid, tid, comm in threads:
        rows = {kind: table.get((kind, pid, tid, comm), Counter()) for kind in ("ours", "peer")}
        if sum(sum(c.values()) for c in rows.values()) < 0.05:
            continue
        print(f"pid {pid} {comm} ({tid})")
        for kind, c in rows.items():
            cpu = sum(v for k, v in c.items() if not k.startswith("#"))
            parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))
            print(f"    {kind}: CPU {cpu:.2f} ms  {parts}")


if __name__ == "__main__":
    main(sys.argv)
