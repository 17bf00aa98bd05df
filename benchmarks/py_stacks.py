"""Where the stage processes' main threads spend their CPU outside the layers, from py-spy samples.

Record a run of ours or of the peer with py-spy's raw (collapsed-stack) output, every process of
the run sampled, only samples of threads on a CPU kept (py-spy's default), without stopping the
processes to sample them (``--nonblocking``), then read the file::

    pip install py-spy
    C="chunks=8 warmup=4 memory=false predict=false timed=100"
    py-spy record --nonblocking --subprocesses --format raw -r 250 -o ours.txt -- \\
        python -m benchmarks.benchmark schedule=interleaved_1f1b virtual_stages=2 $C 'runs=[ours]'
    python -m benchmarks.py_stacks ours.txt

Each sample of a stage process's training loop (a stack through ``run_ours`` or ``run_peer`` of
:mod:`benchmarks.worker`) falls into one class, the first that matches its stack:

- ``layers``: the autograd engine's backward, or a frame of a layer's own code (``torch.nn``'s
  modules but ``Module``'s call machinery, the benchmark's workloads);
- ``send``: ours' :meth:`~lightning_gpipe.transport.p2p.P2P.send`, or a ``dist.isend``;
- ``receive``: ours' :meth:`~lightning_gpipe.transport.p2p.P2P.recv` and announcements, or a ``dist.irecv``
  or the peer's wait for its receives;
- ``optimizer``: the optimizer's update and ``zero_grad``;
- ``other``: the rest (the executor or the peer's schedule, Lightning, the loss, the timeline).

It prints, per class, the samples and their share of all, and the most frequent innermost frames
of ``send`` and ``receive``. Shares compare runs of equal steps; the peer's and ours' layers are
the same work, so the difference of their ``layers`` samples is the noise between two runs.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable

__all__ = ["CLASSES", "classify", "main", "read"]

CLASSES = ("layers", "send", "receive", "optimizer", "other")
_SEND = ("P2P.send (", "isend (")
_RECEIVE = ("P2P.recv (", "P2P.expect (", "P2P.receive_now (", "irecv (", "_wait_batch_p2p (")
_OPTIMIZER = ("_single_tensor_sgd (", "_multi_tensor_sgd (", "Optimizer.zero_grad (")
_LOOPS = ("run_ours (", "run_peer (")


def read(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    """``(frames, samples)`` of each line of py-spy's raw output (``frame;frame;… count``)."""
    out = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _is_layer(frame: str) -> bool:
    if frame.startswith("_engine_run_backward ("):
        return True
    _, _, where = frame.partition(" (")
    if "torch/nn/modules/" in where:
        return not where.startswith(("torch/nn/modules/module.py", "torch/nn/modules/container.py"))
    return where.startswith(("benchmarks/workloads.py", "recipes/models/"))


def classify(frames: list[str]) -> str | None:
    """The class of one stack (``None``: not a stage process's training loop)."""
    if not any(f.startswith(_LOOPS) for f in frames):
        return None
    if any(_is_layer(f) for f in frames):
        return "layers"
    for name, marks in (("send", _SEND), ("receive", _RECEIVE), ("optimizer", _OPTIMIZER)):
        if any(f.startswith(marks) for f in frames):
            return name
    return "other"


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        stacks = read(f)
    totals: Counter[str] = Counter()
    inner: dict[str, Counter[str]] = {"send": Counter(), "receive": Counter()}
    for frames, n in stacks:
        kind = classify(frames)
        if kind is None:
            continue
        totals[kind] += n
        if kind in inner:
            inner[kind][frames[-1]] += n
    everything = sum(totals.values())
    print(f"{everything} samples of the stage processes' training loops")
    for kind in CLASSES:
        print(f"{kind:10s} {totals[kind]:8d}  {100 * totals[kind] / max(everything, 1):5.2f} %")
    for kind, frames in inner.items():
        print(f"-- {kind}: innermost frames")
        for frame, n in frames.most_common(8):
            print(f"{n:8d}  {frame}")


if __name__ == "__main__":
    main(sys.argv[1:])
