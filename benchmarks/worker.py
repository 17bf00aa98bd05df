"""Worker of ``benchmarks/benchmark.py``: one timed run of one configuration, in its own processes.

Usage: ``python -m benchmarks.worker SPEC.json`` (the benchmark writes the spec; ``python -m
benchmarks.benchmark mode=spec spec=SPEC.json …`` writes it without running). ``run`` is one of:

- ``ours``: :class:`~lightning_gpipe.GPipeStrategy` under a Lightning ``Trainer`` (Lightning's
  launcher re-runs this command for the other stages), with ``timeline=True`` and the spec's
  ``schedule`` and ``virtual_stages``;
- ``bare``: the same :class:`~lightning_gpipe.engine.stage.PipelineStage` per process, driven by a plain
  PyTorch loop (no Lightning): the Lightning overhead is ``ours`` against this; under ``1f1b``
  the loop calls the stage once per micro-batch and backpropagates each loss right after its call,
  as :mod:`lightning_gpipe.strategy.microstep` does (``interleaved_1f1b`` has no bare run);
- ``peer``: ``torch.distributed.pipelining`` on the same split and micro-batches, the spec's
  schedule: ``ScheduleGPipe``, ``Schedule1F1B`` or, under ``interleaved_1f1b``,
  ``ScheduleInterleaved1F1B`` with the peer's stages ``p, p+K, …`` (our parts) on rank ``p``
  (all with ``scale_grads=False``);
- ``single``: the plain model in one process, once with ``threads`` threads (the one-stage baseline
  of the ideal speed-up), once with K × ``threads`` (the same total threads as the pipeline) and
  once with ``threads`` threads on the pipeline's M micro-batches (``single_mb``: the baseline of
  the ideal on the same micro-batch sizes).

With ``alternate``, ``ours`` and ``bare`` take turns with the ``peer`` in their own processes,
``block`` steps each (:class:`Alternation`), and also report the peer's steps and the ratio of
each block pair.

``bare`` and ``peer`` start like ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the
benchmark). Every run takes ``warmup`` steps, then ``timed`` steps whose durations (seconds between
consecutive step ends, optimizer step included) are reported, then, with ``memory``, one step under
:class:`~lightning_gpipe.tools.meter.TensorMemoryMeter`. Every run zeroes gradients the same way
(:func:`_set_to_none`). With ``pin``, each rank of ``ours``, ``bare`` and ``peer`` and its threads run
on cores of their own (:func:`pin_rank`). Each rank writes ``{out}/{run}_rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.workloads import Batch, build_model, loss_fn, make_batches, summed_loss_fn
from lightning_gpipe.engine.microbatch import split
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.partition.cut import cut, virtual_cut
from lightning_gpipe.schedule import SCHEDULES
from lightning_gpipe.strategy.microstep import split_batch
from lightning_gpipe.tools.meter import TensorMemoryMeter, peak_rss_bytes
from lightning_gpipe.tools.timeline import Timeline, gather, step_stats
from lightning_gpipe.tools.trace import plot_gantt, write_chrome_trace
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.p2p import P2P

# -- measurement helpers ---------------------------------------------------------------------------


class Stopwatch:
    """Step-end stamps: :meth:`timed_steps` gives the timed steps' durations and :meth:`timed_cpu`
    the CPU time the process (all its threads, user and system) spent in each, both in seconds."""

    def __init__(self, warmup: int, timed: int) -> None:
        self.warmup, self.timed = warmup, timed
        self.stamps: list[float] = []
        self.cpu: list[float] = []

    def stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def _timed(self, marks: list[float]) -> list[float]:
        ends = marks[self.warmup - 1 : self.warmup + self.timed]
        return [b - a for a, b in zip(ends, ends[1:])]

    def timed_steps(self) -> list[float]:
        return self._timed(self.stamps)

    def timed_cpu(self) -> list[float]:
        return self._timed(self.cpu)


def _result(spec: dict[str, Any], watch: Stopwatch, meter: TensorMemoryMeter | None, **extra: Any) -> dict:
    return {
        "step_s": watch.timed_steps(),
        "cpu_s": watch.timed_cpu(),
        "activation_bytes": meter.peak if meter is not None else None,
        "rss_bytes": peak_rss_bytes(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "huge_page_bytes": huge_page_bytes(),
        **extra,
    }


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``), or ``None`` where the file is not there (not Linux)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in text.splitlines() if line.startswith("AnonHugePages:")), None)
    return int(kib) * 1024 if kib is not None else None


def _timeline_summary(records: list[dict[str, Any]] | None, spec: dict[str, Any]) -> dict[str, Any]:
    """Per timed step: the pipeline's bubble, each stage's idle share of the window (stage order),
    and the window (seconds), from gathered timeline records."""
    if not records:
        return {}
    lo, hi = spec["warmup"], spec["warmup"] + spec["timed"]
    stats = [s for s in step_stats(records) if lo <= s.index < hi]
    return {
        "bubble": [s.bubble for s in stats],
        "stage_bubble": [list(s.stage_bubble) for s in stats],
        "window_s": [s.window for s in stats],
        "busy_s": [list(s.busy) for s in stats],
        "spans": _span_medians(records, lo, hi),
        "latency_eff_s": _effective_latency(records, lo, hi),
    }


def _effective_latency(records: list[dict[str, Any]], lo: int, hi: int) -> float | None:
    """Median seconds a message takes once both sides are ready, in the run itself.

    For each activation (stage j → j+1, forward phase) and gradient (j+1 → j, backward phase):
    ``recv end - max(send start, recv start)``. On a busy machine this is far above an idle
    ping-pong's latency, because the sender's transport thread needs a CPU while it computes.
    """
    by_stage = {r["stage"]: r for r in records if r["replica"] == 0}
    delays = []
    for j in range(len(by_stage) - 1):
        for index in range(lo, hi):
            a, b = by_stage[j]["events"].get(index), by_stage[j + 1]["events"].get(index)
            if a is None or b is None:
                continue
            for sender, receiver, phase in ((a, b, "forward"), (b, a, "backward")):
                sends = _phase_spans(sender, "send", phase)
                recvs = _phase_spans(receiver, "recv", phase)
                for i, (s0, _) in sends.items():
                    if i in recvs:
                        r0, r1 = recvs[i]
                        delays.append(r1 - max(s0, r0))
    return sorted(delays)[len(delays) // 2] if delays else None


def _phase_spans(
    events: list[tuple[str, int, float, float, int]], kind: str, phase: str
) -> dict[tuple, tuple]:
    """``kind`` spans by (micro-batch, virtual stage), before (forward) or after (backward) the
    stage's first backward."""
    first_backward = min((a for k, _, a, _, _ in events if k == "backward"), default=float("inf"))
    return {
        (i, u): (a, b)
        for k, i, a, b, u in events
        if k == kind and ((a < first_backward) if phase == "forward" else (a >= first_backward))
    }


def _span_medians(records: list[dict[str, Any]], lo: int, hi: int) -> dict[str, list[float]]:
    """Per stage (stage order), the median seconds of each span kind over the timed steps."""
    out: dict[str, list[float]] = {}
    for rec in sorted(records, key=lambda r: r["stage"]):
        by_kind: dict[str, list[float]] = {}
        for index, events in rec["events"].items():
            if lo <= index < hi:
                for kind, _, a, b, _ in events:
                    by_kind.setdefault(kind, []).append(b - a)
        for kind, values in by_kind.items():
            out.setdefault(kind, []).append(sorted(values)[len(values) // 2])
    return out


def _set_to_none(spec: dict[str, Any]) -> bool:
    """``zero_grad(set_to_none=)`` of every run: PyTorch's and Lightning's default (gradients freed
    after each step) in throughput runs; with ``memory``, gradients stay allocated, so that the
    metered step counts the step's own tensors and not the gradients' first allocation."""
    return not spec["memory"]


def _steps(spec: dict[str, Any]) -> int:
    return spec["warmup"] + spec["timed"] + (1 if spec["memory"] else 0)


def _is_memory_step(spec: dict[str, Any], step: int) -> bool:
    return spec["memory"] and step == spec["warmup"] + spec["timed"]


# -- ours: GPipeStrategy under Lightning ----------------------------------------------------------


def run_ours(spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    import lightning_gpipe

    model_cfg = spec["model"]
    loss = loss_fn(model_cfg)
    watch = Stopwatch(spec["warmup"], spec["timed"])
    meters: list[TensorMemoryMeter] = []
    turns = Alternation.of(spec)

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = build_model(model_cfg)

        def forward(self, x: Tensor) -> Tensor:
            return self.layers(x)

        def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
            x, y = batch
            return loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=spec["lr"])

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=_set_to_none(spec))  # as in the other runs

    class Measure(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            if turns is not None:
                turns.start()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if _is_memory_step(spec, batch_idx):
                meters.append(TensorMemoryMeter())
                meters[0].__enter__()

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if meters and _is_memory_step(spec, batch_idx):
                meters[0].__exit__(None, None, None)
            elif turns is not None:
                turns.after_ours(*batch)
            else:
                watch.stamp()

    batches = make_batches(model_cfg, spec["batch_size"])
    loader = DataLoader([batches[s % len(batches)] for s in range(_steps(spec))], batch_size=None)
    strategy = lightning_gpipe.GPipeStrategy(
        chunks=spec["chunks"],
        balance=spec["balance"],
        checkpoint=spec["checkpoint"],
        schedule=spec.get("schedule", "gpipe"),
        virtual_stages=spec.get("virtual_stages", 1),
        timeline=turns is None,  # in turns with the peer, as users run it (the peer records none)
        timeline_dir=spec["out"],
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=spec["stages"],
        max_steps=_steps(spec),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Measure()],
    )
    trainer.fit(BenchModule(), loader)
    result = _result(spec, watch, meters[0] if meters else None, stage=strategy.stage_index)
    if turns is not None:
        result.update(turns.result())
    result.update(_timeline_summary(strategy.timeline_records, spec))
    return trainer.global_rank, result


class Alternation:
    """Ours and the :class:`Peer` taking turns in the same processes, ``block`` steps each, so that
    both see the same machine within seconds of each other (the host's drift over a run cancels in
    the ratio of neighbouring blocks). The first step of each block (the one after the other's
    turn) and the blocks of the ``warmup`` steps are not timed. The result also holds each timed
    step's span (``turn_windows``, ``time.perf_counter`` seconds: ``CLOCK_MONOTONIC`` on Linux), which
    :mod:`benchmarks.perf_turns` matches with ``perf`` samples."""

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Alternation | None:
        """The spec's alternation (``alternate``), or ``None``."""
        if not spec.get("alternate"):
            return None
        if spec["memory"]:
            raise ValueError("alternate=true measures time only: set memory=false")
        return cls(spec)

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.block = spec, spec.get("block", 4)
        if self.block < 2:
            raise ValueError(f"block={self.block}: a block needs 2 steps or more (its first is not timed)")
        self.peer: Peer | None = None
        self.ours: list[list[float]] = []  # per block, the timed steps' seconds
        self.peers: list[list[float]] = []
        self.windows: dict[str, list[list[list[float]]]] = {"ours": [], "peer": []}  # per block, per step
        self.cpu: dict[str, list[list[float]]] = {"ours": [], "peer": []}  # per block, CPU seconds per step
        self.steps = 0
        self.mark = 0.0
        self.cpu_mark = 0.0

    def start(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.peer = Peer(self.spec, rank, world, dist.new_group(backend="gloo"), ours_layout=True)
        self.mark, self.cpu_mark = time.perf_counter(), time.process_time()

    def after_ours(self, x: Tensor, y: Tensor) -> None:
        assert self.peer is not None
        now, cpu = time.perf_counter(), time.process_time()
        self.steps += 1
        at = (self.steps - 1) % self.block
        if at == 0:
            self.ours.append([])
            self.windows["ours"].append([])
            self.cpu["ours"].append([])
        else:
            self.ours[-1].append(now - self.mark)
            self.windows["ours"][-1].append([self.mark, now])
            self.cpu["ours"][-1].append(cpu - self.cpu_mark)
        self.mark, self.cpu_mark = now, cpu
        if at == self.block - 1:
            times, spans, cpus = [], [], []
            for _ in range(self.block):
                self.peer.step(x, y)
                now, last, cpu = time.perf_counter(), self.mark, time.process_time()
                times.append(now - last)
                spans.append([last, now])
                cpus.append(cpu - self.cpu_mark)
                self.mark, self.cpu_mark = now, cpu
            self.peers.append(times[1:])
            self.windows["peer"].append(spans[1:])
            self.cpu["peer"].append(cpus[1:])

    def result(self) -> dict[str, Any]:
        first = -(-self.spec["warmup"] // self.block)  # blocks holding warm-up steps
        ours, peers = self.ours[first : len(self.peers)], self.peers[first:]
        windows = {k: [w for b in v[first : len(self.peers)] for w in b] for k, v in self.windows.items()}
        return {
            "step_s": [t for b in ours for t in b],
            "peer_step_s": [t for b in peers for t in b],
            "block_ratios": [_median(p) / _median(o) for o, p in zip(ours, peers)],
            "cpu_block_ratios": [  # this process's CPU seconds per step, the peer's over ours
                _median(p) / _median(o)
                for o, p in zip(self.cpu["ours"][first : len(self.peers)], self.cpu["peer"][first:])
            ],
            "turn_windows": windows,
        }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# -- bare: our PipelineStage in a plain loop ------------------------------------------------------


def _init_process_group() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _probe_p2p(
    p2p: P2P, me: int, other: int, first: bool, nbytes: int, repeats: int = 20
) -> tuple[float, float]:
    """One-way seconds of a 1-element and of an ``nbytes`` message (header included), by ping-pong."""
    times = []
    for numel in (1, max(1, nbytes // 4)):
        payload = torch.zeros(numel)
        rtts = []
        for _ in range(repeats):
            start = time.perf_counter()
            if first:
                p2p.send([payload], other)
                p2p.recv(other)
            else:
                p2p.recv(other)
                p2p.send([payload], other)
            p2p.flush()
            rtts.append(time.perf_counter() - start)
        times.append(sorted(rtts)[len(rtts) // 2] / 2)
    return times[0], times[1]


def _probe_gloo(other: int, first: bool, repeats: int = 50) -> float:
    """One-way seconds of a 1-element message by ping-pong on ``torch.distributed``'s own
    ``isend``/``irecv`` (what the transport's :func:`_probe_p2p` figure is to be compared with)."""
    out, into = torch.zeros(1), torch.zeros(1)
    rtts = []
    for _ in range(repeats):
        start = time.perf_counter()
        if first:
            dist.isend(out, other).wait()
            dist.irecv(into, other).wait()
        else:
            dist.irecv(into, other).wait()
            dist.isend(out, other).wait()
        rtts.append(time.perf_counter() - start)
    return sorted(rtts)[len(rtts) // 2] / 2


def _bare_micro_steps(stage: PipelineStage, loss: Any, x: Tensor, y: Tensor, chunks: int) -> None:
    """One step of one call per micro-batch: each call's loss, weighted by its share of the batch,
    backpropagated right after it (the last stage), then the step outcome shared, as
    :mod:`lightning_gpipe.strategy.microstep` and the strategy's ``training_step`` do."""
    micro, parts = split_batch((x, y), chunks)
    total = sum(parts)
    stage.start_micro_steps(len(micro))
    last = None
    for i, (xi, yi) in enumerate(micro):
        out = stage.run_step(stage, True, xi)
        if stage.topology.is_last:
            last = loss(out, yi) * (parts[i] / total)
            last.backward()
            stage.loss_backpropagated(i)
    stage.end_micro_steps()
    stage.share_outcome(last, None, training=True)


def run_bare(spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    rank, world = _init_process_group()
    layout = Layout(world, world)
    stage_index = layout.stage_of(rank)
    topology = layout.topology(rank)
    model_cfg = spec["model"]
    p2p = P2P(torch.device("cpu"))
    stage = PipelineStage(
        cut(build_model(model_cfg), spec["balance"], stage_index),
        topology,
        spec["chunks"],
        spec["checkpoint"],
        p2p,
        schedule=SCHEDULES[spec.get("schedule", "gpipe")],
    )
    per_micro_batch = spec.get("schedule", "gpipe") != "gpipe"
    timeline = stage.timeline = Timeline(stage_index, world, rank)
    probe: dict[str, float] = {}
    if world > 1 and stage_index >= world - 2:  # the last boundary: ranks 0 and 1
        small, big = _probe_p2p(p2p, rank, 1 - rank, stage_index == world - 1, spec["boundary_bytes"])
        gloo = _probe_gloo(1 - rank, stage_index == world - 1)
        probe = {"latency_s": small, "boundary_s": big, "latency_gloo_s": gloo}
    dist.barrier()
    turns = Alternation.of(spec)
    if turns is not None:
        turns.start()
    loss = loss_fn(model_cfg)
    optimizer = torch.optim.SGD(stage.parameters(), lr=spec["lr"])
    batches = make_batches(model_cfg, spec["batch_size"])
    watch, meter = Stopwatch(spec["warmup"], spec["timed"]), None
    for step in range(_steps(spec)):
        x, y = batches[step % len(batches)]
        if _is_memory_step(spec, step):
            meter = TensorMemoryMeter()
        with meter if meter is not None else nullcontext():
            timeline.begin_step(step)
            if per_micro_batch:
                _bare_micro_steps(stage, loss, x, y, spec["chunks"])
            else:
                out = stage.run_step(stage, True, x)
                if topology.is_last:
                    loss(out, y).backward()
            stage.backward()
            timeline.end_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=_set_to_none(spec))
        if turns is not None:
            turns.after_ours(x, y)
        elif meter is None:
            watch.stamp()
    result = _result(spec, watch, meter, stage=stage_index, **probe)
    if turns is not None:
        result.update(turns.result())
    records = gather(timeline)
    result.update(_timeline_summary(records, spec))
    if records:
        write_chrome_trace(records, Path(spec["out"], "bare_timeline.json"))
        plot_gantt(records, Path(spec["out"], "bare_timeline.png"))
    dist.destroy_process_group()
    return rank, result


# -- peer: torch.distributed.pipelining, the same schedule -----------------------------------------


class Peer:
    """``torch.distributed.pipelining`` on this rank: the spec's schedule over the same split and
    micro-batches, its own SGD; :meth:`step` runs one training step (``group``: the ranks' group).

    With ``ours_layout`` each process holds the stage ours holds there (stage ``K-1-rank``: the
    last stage on rank 0, :mod:`lightning_gpipe.transport.layout`), so that in turns (:class:`Alternation`)
    every process plays one role for both; otherwise stage ``rank``, the peer's default."""

    def __init__(
        self, spec: dict[str, Any], rank: int, world: int, group: Any = None, ours_layout: bool = False
    ) -> None:
        from torch.distributed.pipelining import PipelineStage as PeerStage
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        stage = world - 1 - rank if ours_layout else rank
        self.spec, self.stage, self.world = spec, stage, world
        model_cfg = spec["model"]
        name = spec.get("peer_schedule") or spec.get("schedule", "gpipe")
        if name != spec.get("schedule", "gpipe") and (
            name == "interleaved_1f1b" or spec.get("virtual_stages", 1) > 1
        ):
            raise ValueError(
                f"peer_schedule={name!r} with schedule={spec.get('schedule')!r}: "
                "a yardstick runs one virtual stage per stage"
            )
        parts = len(spec["balance"])  # K, or K·v with virtual stages: stage s runs parts s, s+K, ...
        submodules = [
            nn.Sequential(OrderedDict(layers))
            for layers in virtual_cut(build_model(model_cfg), spec["balance"], stage, world)
        ]
        stages = [
            PeerStage(sub, stage + u * world, parts, torch.device("cpu"), group=group)
            for u, sub in enumerate(submodules)
        ]
        options = {
            "n_microbatches": spec["chunks"],
            "loss_fn": summed_loss_fn(model_cfg, spec["batch_size"]),
            "scale_grads": False,
        }
        multi = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zb_h1": ScheduleInterleavedZeroBubble}
        if name in multi:  # zb_h1: the peer's zero-bubble schedule with one stage per rank
            self.schedule: Any = multi[name](stages, **options)
        else:
            self.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], **options)
        if ours_layout and name in multi:  # group rank r runs what rank K-1-r would
            order = self.schedule.pipeline_order  # (its lowering derives the stage mapping from this)
            self.schedule.pipeline_order = {r: order[world - 1 - r] for r in order}
            self.schedule._prepare_schedule_with_comms(self.schedule.pipeline_order)
        elif ours_layout:  # stage s on group rank K-1-s
            for peer_stage in stages:
                peer_stage.stage_index_to_group_rank = {c: world - 1 - c for c in range(parts)}
        self.optimizer = torch.optim.SGD([p for sub in submodules for p in sub.parameters()], lr=spec["lr"])

    def step(self, x: Tensor, y: Tensor) -> None:
        args = (x,) if self.stage == 0 else ()
        kwargs = {"target": y} if self.stage == self.world - 1 else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=_set_to_none(self.spec))


def run_peer(spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    rank, world = _init_process_group()
    peer = Peer(spec, rank, world)
    batches = make_batches(spec["model"], spec["batch_size"])
    watch, meter = Stopwatch(spec["warmup"], spec["timed"]), None
    for step in range(_steps(spec)):
        if _is_memory_step(spec, step):
            meter = TensorMemoryMeter()
        with meter if meter is not None else nullcontext():
            peer.step(*batches[step % len(batches)])
        if meter is None:
            watch.stamp()
    result = _result(spec, watch, meter, stage=rank)
    dist.destroy_process_group()
    return rank, result


# -- single: the plain model in one process -------------------------------------------------------


def run_single(spec: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The plain model in one process: with ``threads`` threads (key ``threads{n}``), with K ×
    ``threads`` (the pipeline's total), and, when ``chunks`` > 1, with ``threads`` threads on the
    pipeline's micro-batches, gradients accumulated over them (key ``micro{n}``: one stage doing
    all the work, so that the ideal speed-up is measured on the same micro-batch sizes)."""
    model_cfg = spec["model"]
    loss, summed = loss_fn(model_cfg), summed_loss_fn(model_cfg, spec["batch_size"])
    batches = make_batches(model_cfg, spec["batch_size"])
    result: dict[str, Any] = {"stage": 0}
    variants = [(f"threads{t}", t, 1) for t in sorted({spec["threads"], spec["stages"] * spec["threads"]})]
    if spec["chunks"] > 1:
        variants.append((f"micro{spec['threads']}", spec["threads"], spec["chunks"]))
    for key, threads, chunks in variants:
        torch.set_num_threads(threads)
        model = build_model(model_cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        watch, meter = Stopwatch(spec["warmup"], spec["timed"]), None
        for step in range(_steps(spec)):
            x, y = batches[step % len(batches)]
            if _is_memory_step(spec, step):
                meter = TensorMemoryMeter()
            with meter if meter is not None else nullcontext():
                if chunks == 1:
                    loss(model(x), y).backward()
                else:
                    for xs, ys in zip(split([x], chunks), split([y], chunks)):
                        summed(model(xs[0]), ys[0]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=_set_to_none(spec))
            if meter is None:
                watch.stamp()
        result[key] = _result(spec, watch, meter, threads=threads)
    return 0, result


RUNS = {"ours": run_ours, "bare": run_bare, "peer": run_peer, "single": run_single}


_CPUS = "GPIPE_BENCH_CPUS"


def pin_rank(rank: int, threads: int, cpus: list[int]) -> list[int]:
    """The cores rank ``rank`` of a run with ``threads`` threads per rank runs on: ``threads`` of
    ``cpus`` (the cores this process may use), rank 0 on the first ones, wrapping around when the
    ranks need more cores than there are."""
    return [cpus[(rank * threads + t) % len(cpus)] for t in range(threads)]


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[1]).read_text())
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)  # a spec from mode=spec names a folder to create
    if spec.get("pin") and spec["run"] != "single":  # before any thread starts: they inherit it
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        # the job's cores, as the first process found them (Lightning's launcher starts the other
        # ranks from a pinned process: they inherit this variable, not its cores)
        job = os.environ.setdefault(_CPUS, ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
        os.sched_setaffinity(0, pin_rank(rank, spec["threads"], [int(c) for c in job.split(",")]))
    torch.set_num_threads(spec["threads"])
    if spec.get("profile"):  # cProfile every rank: {out}/{run}_{pid}.prof
        import cProfile

        with cProfile.Profile() as prof:
            rank, result = RUNS[spec["run"]](spec)
        prof.dump_stats(Path(spec["out"], f"{spec['run']}_{os.getpid()}.prof"))
    else:
        rank, result = RUNS[spec["run"]](spec)
    result["pid"] = os.getpid()
    Path(spec["out"], f"{spec['run']}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
