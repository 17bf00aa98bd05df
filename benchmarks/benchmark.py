"""Measure the pipeline: throughput against the ideal and against PyTorch's own pipelining, memory,
bubble share, the cost model's error, and the largest model that fits a memory budget.

``mode=throughput`` (one configuration: model, stages K, chunks M, checkpoint mode; Hydra
``-m`` sweeps over any of them) runs, one after another, each in fresh processes
(:mod:`benchmarks.worker`):

- ``ours``: :class:`~lightning_gpipe.GPipeStrategy` under Lightning, ``timeline=True`` (but in
  ``alternate`` runs, where it runs as users run it: the peer records no timeline), with the
  config's ``schedule`` and ``virtual_stages``;
- ``bare``: the same stages driven by a plain PyTorch loop (Lightning overhead = ours vs bare);
  fill-drain only, skipped under another schedule;
- ``peer``: ``torch.distributed.pipelining``'s same schedule with ``scale_grads=False``, same split
  and micro-batches: ``ScheduleGPipe``, ``Schedule1F1B``, or ``ScheduleInterleaved1F1B`` holding
  our parts ``p, p+K, …`` on rank ``p`` under ``schedule=interleaved_1f1b``;
- ``peer_schedule``: the peer's schedule, where it differs from ours (a yardstick: ``schedule=zb_h1
  peer_schedule=1f1b`` and ``schedule=1f1b peer_schedule=1f1b``, both alternating, give our ZB-H1's
  gain over our 1F1B as the ratio of their ``vs_peer_alternating``, each measured against the same
  peer within seconds); one virtual stage per stage;
- ``alternate=true``: ``ours`` and ``bare`` each take turns with the peer in their own processes,
  ``block`` steps each (the peer on a process group of its own), and report
  ``vs_peer_alternating``: the median over blocks of the peer's median step over theirs in the
  block before (each block's first step, after the other's turn, untimed), and
  ``vs_peer_alternating_ci``, that median's 95 % distribution-free interval
  (:func:`median_interval`). Neighbouring blocks are seconds apart, so a drift of the host's speed,
  which separate runs minutes apart both see differently, cancels in each ratio. With ``repeats`` >
  1 the blocks of every repeat are pooled (:func:`pool_turns`; each repeat's median in
  ``vs_peer_alternating_repeats``);
- ``single``: the plain model in one process with 1 thread (the one-stage baseline), with
  K × ``threads`` threads (the pipeline's total, row ``single_mt``) and with 1 thread on the
  pipeline's M micro-batches, gradients accumulated (row ``single_mb``).

Every run reports samples/s (``batch_size`` / median seconds between step ends over the timed
steps; with ``repeats`` > 1 the list runs again, interleaved, and each run keeps its least
disturbed repeat, which matters on a shared machine), the peak tensor bytes of one step per
stage (:class:`lightning_gpipe.tools.meter.TensorMemoryMeter`) and peak RSS; ``ours`` and ``bare`` also the
bubble share, each stage's idle share of the window (``bubble_stages``) and the step window from
the timeline. With ``predict``, each stage's saved bytes are profiled layer by layer
(:func:`lightning_gpipe.balance.profile_layers`, one micro-batch) for the cost model's activation
memory, with each part's backward workspace (its backward's peak above what its forward kept,
under the tensor-memory meter) and the output's bytes per sample; each stage's measured peak is
printed next to the model's; :func:`lightning_gpipe.tools.simulate.simulate` predicts the step
window from the run's own per-stage forward/backward span medians (timeline) and the P2P latency
of a ping-pong in ``bare`` (and, as a second prediction, the in-run message delay); that latency
is printed next to the same ping-pong on ``torch.distributed``'s own ``isend``/``irecv``
(``latency_gloo_s``). Rows are appended to ``csv`` and printed with the ratios: ours/ideal, where
ideal = K·M/(M+(K-1)/v) × single-stage (1 thread) samples/s (v = 1 but under
``interleaved_1f1b``: the bubble-limited speed-up, Narayanan et al., SC 2021, section 2.2.1); the
same against the ideal from ``single_mb`` (one process on the same micro-batches, so that the
smaller matrices' slower kernels are not counted against the schedule); ours/peer; and the
Lightning overhead ``ours step / bare step - 1``.

``mode=capacity`` (GPipe Table 1's point) bisects ``model.num_layers`` for the largest model whose
one-stage training step (``chunks`` micro-batches, Adam) fits ``capacity.budget_bytes``, for each
``capacity.checkpoints`` mode. On CPU the step's need is parameters + gradients + Adam state +
the meter's peak; on CUDA, ``torch.cuda.max_memory_allocated``.

``mode=report`` prints the tables of a CSV: per run and M, samples/s and the ratios, and the M sweep
normalized to M=1 next to GPipe's Table 2 (K=2).

``mode=spec`` writes the worker spec of ``runs[0]`` to ``spec`` and runs nothing: the way to run one
worker under an outside tool (``perf``, ``py-spy``).

Run from the repository root: ``python -m benchmarks.benchmark [key=value ...]``
(``benchmarks/conf/benchmark.yaml``). Results go where ``csv`` says (``benchmarks/results/`` in the
documented commands; it is not versioned, and the folders are created as needed).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from benchmarks.workloads import build_model, loss_fn, make_batches
from lightning_gpipe.balance import balance_by_parameters, balance_by_time, profile_layers
from lightning_gpipe.engine.microbatch import sizes as microbatch_sizes
from lightning_gpipe.partition.cut import check_balance, stage_bounds, uniform_balance
from lightning_gpipe.schedule import ideal_bubble
from lightning_gpipe.tools.launch import JobTimeout, job_env, run_job
from lightning_gpipe.tools.meter import TensorMemoryMeter
from lightning_gpipe.tools.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["COLUMNS", "benchmark", "capacity", "main", "report", "run_env", "worker_spec", "write_spec"]

COLUMNS = [
    "run",
    "model",
    "num_layers",
    "width",
    "params",
    "stages",
    "chunks",
    "checkpoint",
    "balance",
    "batch_size",
    "threads",
    "step_s",
    "step_s_min",
    "samples_per_s",
    "samples_per_s_best",
    "bubble",
    "bubble_ideal",
    "bubble_stages",
    "window_s",
    "forward_s_stages",
    "backward_s_stages",
    "latency_s",
    "bandwidth_bytes_per_s",
    "predicted_window_s",
    "latency_eff_s",
    "predicted_window_eff_s",
    "predicted_bubble",
    "activation_bytes",
    "activation_bytes_stages",
    "predicted_activation_bytes",
    "predicted_activation_bytes_stages",
    "rss_bytes",
    "ideal_samples_per_s",
    "vs_ideal",
    "vs_peer",
    "lightning_overhead",
    "vs_ideal_best",
    "vs_peer_best",
    "lightning_overhead_best",
    "ideal_mb_samples_per_s",
    "vs_ideal_mb",
    "vs_ideal_mb_best",
    "schedule",
    "virtual_stages",
    "vs_peer_paired",
    "vs_peer_paired_repeats",
    "pin",
    "cpus_stages",
    "vs_peer_alternating",
    "vs_peer_alternating_blocks",
    "latency_gloo_s",
    "vs_peer_alternating_ci",
    "vs_peer_alternating_cpu_stages",
    "peer_schedule",
    "vs_peer_alternating_repeats",
    "huge_pages",
    "huge_page_bytes_stages",
]

# The one-process baselines: 1 thread, K threads, 1 thread on the pipeline's micro-batches.
SINGLES = ("single", "single_mt", "single_mb")

# GPipe (arXiv 1811.06965) Table 2, Transformer, K=2: throughput normalized to K=2, M=1.
GPIPE_TABLE2_K2 = {1: 1.0, 4: 1.7, 32: 1.8}


# -- launching workers ---------------------------------------------------------------------------


def _wait_for_quiet(max_wait: float, busy: float = 15.0) -> None:
    """On a shared machine, wait up to ``max_wait`` seconds for the CPUs to be at most ``busy`` % used
    (``psutil.cpu_percent`` over one second)."""
    deadline = time.monotonic() + max_wait
    while max_wait > 0 and time.monotonic() < deadline and psutil.cpu_percent(interval=1.0) > busy:
        time.sleep(2.0)


def run_env(spec: dict[str, Any]) -> dict[str, str]:
    """The environment of one worker job: :func:`~lightning_gpipe.tools.launch.job_env` with
    ``threads`` and ``THP_MEM_ALLOC_ENABLE`` set by ``huge_pages`` (``"1"``: PyTorch's CPU allocator
    places each tensor of 2 MiB or more on transparent huge pages, ``madvise(MADV_HUGEPAGE)``; ``"0"``
    also where the calling shell set it). PyTorch reads the variable once, at a process's first
    allocation of 2 MiB or more, so it is set before the processes start."""
    return job_env(spec["threads"], {"THP_MEM_ALLOC_ENABLE": "1" if spec.get("huge_pages") else "0"})


def _launch(spec: dict[str, Any], timeout: float) -> None:
    """Run one worker job (:func:`lightning_gpipe.tools.launch.run_job`), killed after ``timeout`` seconds.

    ``ours``: one process, Lightning's launcher starts the other stages; ``bare``/``peer``: one
    process per rank, started as ``torchrun`` starts them.

    Raises:
        RuntimeError: a process failed or timed out; the message holds the output's tail.
    """
    path = Path(spec["out"]) / f"{spec['run']}.json"
    path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "benchmarks.worker", str(path)]
    ranks = spec["stages"] if spec["run"] in ("bare", "peer") else None
    try:
        results = run_job(command, ranks=ranks, env=run_env(spec), cwd=ROOT, timeout=timeout)
    except JobTimeout as err:
        raise RuntimeError(
            f"benchmark run {spec['run']!r} killed after {timeout} s:\n{str(err)[-8000:]}"
        ) from None
    if any(code != 0 for code, _ in results):
        tail = "\n".join(out[-4000:] for _, out in results)
        raise RuntimeError(f"benchmark run {spec['run']!r} failed:\n{tail}")


# -- throughput ------------------------------------------------------------------------------------


def _balance(cfg: DictConfig, model: torch.nn.Sequential, sample: torch.Tensor) -> list[int]:
    """Layers per part: ``K`` parts, or ``K·v`` with ``virtual_stages`` v (parts in model order)."""
    stages, balance = cfg.stages * cfg.virtual_stages, cfg.balance
    if balance == "uniform":
        return uniform_balance(len(model), stages)
    if balance == "parameters":
        return balance_by_parameters(model, stages)
    if balance == "time":
        return balance_by_time(model, sample, stages)
    return check_balance(list(balance), len(model), stages)


def _profile(
    model: torch.nn.Sequential, balance: list[int], sample: torch.Tensor, threads: int
) -> dict[str, list[float]]:
    """Per part (``len(balance)``: one per stage, or ``K·v`` with virtual stages): forward and
    backward seconds of one micro-batch ``sample``, bytes per sample the part holds from its
    forward to its backward (``activation``: what its forward leaves alive, :func:`_part_memory`,
    and, on a part after the first, its input, a message the stage received) and of the part's
    input (``input``), and bytes its backward needs beyond that (``workspace``); ``recomputed``:
    bytes per sample a re-materialized part holds (its output and, after the first part, its
    received input); ``output``: bytes per sample of the model's output (the loss's input)."""
    torch.set_num_threads(threads)
    layers = profile_layers(model, sample, timeout=1.5, warmup=2)
    per_sample = 1.0 / sample.shape[0]
    input_bytes, x = [], sample
    out: dict[str, list[float]] = {"forward": [], "backward": []}
    with torch.no_grad():
        for a, b in stage_bounds(balance):
            input_bytes.append(x.numel() * x.element_size() * per_sample)
            for layer in list(model)[a:b]:
                x = layer(x)
            out["forward"].append(sum(p.forward_time for p in layers[a:b]))
            out["backward"].append(sum(p.backward_time for p in layers[a:b]))
    out["input"] = input_bytes
    out["boundary_bytes_per_sample"] = input_bytes[1:]
    out["output"] = [x.numel() * x.element_size() * per_sample]
    kept, out["workspace"] = _part_memory(model, balance, sample)
    out["activation"] = [k * per_sample + (input_bytes[c] if c > 0 else 0.0) for c, k in enumerate(kept)]
    # a re-materialized part holds its output and, after the first part, its received input
    outputs = [*input_bytes[1:], out["output"][0]]
    out["recomputed"] = [(input_bytes[c] if c > 0 else 0.0) + outputs[c] for c in range(len(kept))]
    return out


def _part_memory(
    model: torch.nn.Sequential, balance: list[int], sample: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Per part, under :class:`TensorMemoryMeter` on one micro-batch ``sample``: the bytes its
    forward leaves alive (the tensors saved for backward and its output, which the stage holds
    for the backward; not its input), and the bytes its backward needs at its peak beyond them
    (the workspace): the gradients passed between layers, each weight's gradient before it is
    added into ``.grad`` (which exists, as in every step after the first) and, but on the last
    part, the gradient received from the next part (the last part's comes from the loss, counted
    with the loss's side: ``output_bytes``)."""
    kept, workspace, x = [], [], sample
    for c, (a, b) in enumerate(stage_bounds(balance)):
        part = torch.nn.Sequential(*list(model)[a:b])
        x = x.detach().requires_grad_(c > 0)  # a received activation needs its gradient sent back
        out = part(x)
        out.sum().backward()  # create .grad
        dy = torch.ones_like(out) if b == len(model) else None  # the last part's: the loss's
        with TensorMemoryMeter() as meter:
            y = part(x)
            kept.append(float(meter.live))
            meter.peak = meter.live
            y.backward(dy if dy is not None else torch.ones_like(y))  # the gradient received
        workspace.append(float(meter.peak - kept[-1]))
        x = y
    model.zero_grad(set_to_none=True)
    return kept, workspace


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median of ``values``: the order statistics
    ``x_(j)`` and ``x_(n+1-j)`` for the largest ``j`` with ``P(Bin(n, 1/2) < j) <= (1 - level) / 2``
    (sign-test interval; e.g. n = 10 at 95 %: the 2nd and the 9th smallest, coverage 97.9 %).
    Assumes only that the values are independent draws of one distribution.

    Returns:
        ``(low, high)``, or ``None`` where ``n`` is too small for ``level`` (fewer than 6 at 95 %).
    """
    x, n = sorted(values), len(values)
    tail, j, below = (1 - level) / 2, 0, 0.0
    while j < n and below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    return (x[j - 1], x[n - j]) if j else None


def _row(
    cfg: DictConfig,
    run: str,
    result: dict[str, Any],
    stage_results: list[dict],
    params: int,
    balance: list[int],
) -> dict:
    step = result["step_s"]
    act = [r.get("activation_bytes") for r in stage_results]
    k, m = cfg.stages, len(microbatch_sizes(cfg.batch_size, cfg.chunks))
    peer_schedule = cfg.get("peer_schedule") or cfg.schedule
    schedule = (peer_schedule if run == "peer" else cfg.schedule) if run in ("ours", "bare", "peer") else None
    v = cfg.virtual_stages if run in ("ours", "peer") else 1
    return {
        "run": run,
        "model": cfg.model.name,
        "num_layers": cfg.model.num_layers,
        "width": cfg.model.width if cfg.model.name == "mlp" else cfg.model.d_model,
        "params": params,
        "stages": k if run not in SINGLES else 1,
        "chunks": cfg.chunks,
        "checkpoint": cfg.checkpoint,
        "balance": "-".join(str(n) for n in balance),
        "batch_size": cfg.batch_size,
        "threads": result.get("threads", k * cfg.threads),
        "step_s": _median(step),
        "step_s_min": min(step) if step else None,
        "samples_per_s": cfg.batch_size / _median(step) if step else None,
        "samples_per_s_best": cfg.batch_size / min(step) if step else None,
        "bubble": _median(result.get("bubble")),
        "bubble_ideal": ideal_bubble(k, m, v) if run in ("ours", "bare", "peer") else None,
        "bubble_stages": "|".join(f"{b:.4g}" for b in _median_per_stage(result.get("stage_bubble")))
        if result.get("stage_bubble")
        else None,
        "window_s": _median(result.get("window_s")),
        "latency_eff_s": result.get("latency_eff_s"),
        **_span_columns(result.get("spans")),
        "activation_bytes": max(a for a in act if a is not None) if any(a is not None for a in act) else None,
        "activation_bytes_stages": "|".join(str(a) for a in act) if any(a is not None for a in act) else None,
        "rss_bytes": max(r["rss_bytes"] for r in stage_results),
        "schedule": schedule,
        "peer_schedule": peer_schedule if run in ("ours", "bare", "peer") else None,
        "virtual_stages": v if run in ("ours", "bare", "peer") else None,
        "pin": bool(cfg.get("pin", False)) if run in ("ours", "bare", "peer") else None,
        "cpus_stages": "|".join(",".join(str(c) for c in r["cpus"]) for r in stage_results)
        if all("cpus" in r for r in stage_results)
        else None,
        "huge_pages": bool(cfg.get("huge_pages", False)),
        "huge_page_bytes_stages": "|".join(str(r["huge_page_bytes"]) for r in stage_results)
        if all(r.get("huge_page_bytes") is not None for r in stage_results)
        else None,
        "vs_peer_alternating": _median(result.get("block_ratios")),
        "vs_peer_alternating_ci": "|".join(f"{b:.3f}" for b in interval)
        if (interval := median_interval(result.get("block_ratios") or []))
        else None,
        "vs_peer_alternating_blocks": "|".join(f"{b:.3f}" for b in result["block_ratios"])
        if result.get("block_ratios")
        else None,
        "vs_peer_alternating_repeats": "|".join(f"{b:.3f}" for b in result["repeat_ratios"])
        if len(result.get("repeat_ratios") or []) > 1
        else None,
        "vs_peer_alternating_cpu_stages": "|".join(
            f"{_median(r['cpu_block_ratios']):.3f}" for r in stage_results
        )
        if all(r.get("cpu_block_ratios") for r in stage_results)
        else None,
    }


def _median_per_stage(per_step: list[list[float]]) -> list[float]:
    """Per stage, the median over steps of ``per_step[step][stage]``."""
    return [statistics.median(values) for values in zip(*per_step)]


def _span_columns(spans: dict[str, list[float]] | None) -> dict[str, str]:
    """Per-stage median forward and backward seconds (backward without its recompute), ``|``-joined."""
    if not spans or "forward" not in spans:
        return {}
    forward = spans["forward"]
    backward = spans.get("backward", [0.0] * len(forward))
    recompute = spans.get("recompute", [0.0] * len(forward))
    return {
        "forward_s_stages": "|".join(f"{f:.6g}" for f in forward),
        "backward_s_stages": "|".join(f"{max(0.0, b - r):.6g}" for b, r in zip(backward, recompute)),
    }


def _floats(value: Any) -> list[float]:
    return [float(v) for v in str(value).split("|")]


def predict_window(row: dict[str, Any], sizes: list[float] | None = None) -> float | None:
    """The cost model's step window for a benchmark row, from its measured per-stage span medians.

    Args:
        row: a row with ``forward_s_stages``, ``backward_s_stages``, ``stages``, ``chunks``,
            ``checkpoint``, ``batch_size`` and optionally ``latency_s``/``bandwidth_bytes_per_s``,
            ``schedule`` and ``virtual_stages`` (default ``"gpipe"``, 1).
        sizes: bytes per micro-batch at each boundary (needed with a finite bandwidth).

    Returns:
        seconds from the first forward to the last backward, or ``None`` without span columns.
    """
    if not row.get("forward_s_stages") or not row.get("backward_s_stages"):
        return None
    bandwidth = float(row.get("bandwidth_bytes_per_s") or math.inf)
    return simulate(
        int(row["stages"]),
        int(row["chunks"]),
        _floats(row["forward_s_stages"]),
        _floats(row["backward_s_stages"]),
        checkpoint=str(row["checkpoint"]),
        latency=float(row.get("latency_s") or 0.0),
        bandwidth=bandwidth if sizes else math.inf,
        boundary_bytes=sizes or 0.0,
        batch_size=int(row["batch_size"]),
        schedule=str(row.get("schedule") or "gpipe"),
        virtual_stages=int(row.get("virtual_stages") or 1),
    ).step_time


def worker_spec(
    cfg: DictConfig, run: str, model_cfg: dict[str, Any], balance: list[int], boundary: int, out: Path
) -> dict[str, Any]:
    """The spec :mod:`benchmarks.worker` reads for one run of ``cfg``: the model, the split
    (``balance``, layers per part), the schedule, the steps, and ``out``, the folder its ranks
    write their ``{run}_rank{r}.json`` into; ``boundary`` is the bytes of one boundary message
    (``bare``'s ping-pong probes that size too)."""
    return {
        "run": run,
        "model": model_cfg,
        "balance": balance,
        "stages": cfg.stages,
        "chunks": cfg.chunks,
        "checkpoint": cfg.checkpoint,
        "schedule": cfg.schedule,
        "peer_schedule": cfg.peer_schedule or cfg.schedule,
        "virtual_stages": cfg.virtual_stages,
        "batch_size": cfg.batch_size,
        "threads": cfg.threads,
        "pin": _flag(cfg, "pin"),
        "huge_pages": _flag(cfg, "huge_pages"),
        "alternate": _flag(cfg, "alternate") and run in ("ours", "bare"),
        "block": cfg.block,
        "warmup": max(1, cfg.warmup),
        "timed": cfg.timed,
        "memory": _flag(cfg, "memory"),
        "lr": cfg.lr,
        "boundary_bytes": boundary,
        "out": str(out),
    }


def _flag(cfg: DictConfig, key: str) -> bool:
    """``cfg[key]``, which must be ``true`` or ``false``.

    Raises:
        ValueError: anything else (``huge_pages=yes`` reaches here as the string ``"yes"``).
    """
    value = cfg.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false ({key}: {value!r})")
    return value


def write_spec(cfg: DictConfig) -> Path:
    """Write the worker spec of ``cfg.runs[0]`` to ``cfg.spec`` instead of running it, for a run under
    an outside tool (``perf record … -- python -m benchmarks.worker SPEC``); the worker writes its
    results into the spec's folder. Returns the spec's path.

    Raises:
        ValueError: ``spec`` is not set.
    """
    if not cfg.get("spec"):
        raise ValueError("mode=spec needs spec=PATH (where to write the worker's spec)")
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_cfg, dict)
    model = build_model(model_cfg)
    sample = make_batches(model_cfg, microbatch_sizes(cfg.batch_size, cfg.chunks)[0], count=1)[0][0]
    path = Path(str(cfg.spec)).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = worker_spec(cfg, str(cfg.runs[0]), model_cfg, _balance(cfg, model, sample), 0, path.parent)
    path.write_text(json.dumps(spec, indent=1) + "\n")
    env = "THP_MEM_ALLOC_ENABLE=1 " if spec["huge_pages"] else ""
    print(f"benchmark: wrote {path} (run it with: {env}python -m benchmarks.worker {path})", flush=True)
    return path


def benchmark(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run ``cfg.runs`` for one configuration; append the rows to ``cfg.csv``, print and return them.

    Raises:
        RuntimeError: a run failed or timed out (its output's tail is in the message).
        ValueError: an unknown run name or a bad balance.
    """
    unknown = set(cfg.runs) - {"ours", "bare", "peer", "single"}
    if unknown:
        raise ValueError(f"runs may hold ours, bare, peer, single (unknown: {sorted(unknown)})")
    runs = list(cfg.runs)
    if cfg.schedule == "interleaved_1f1b" and "bare" in runs:
        print(
            "benchmark: skipping bare (it runs one virtual stage per stage; schedule=interleaved_1f1b "
            "applies to ours and peer)",
            flush=True,
        )
        runs = [r for r in runs if r != "bare"]
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_cfg, dict)
    model = build_model(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    micro = microbatch_sizes(cfg.batch_size, cfg.chunks)[0]
    sample = make_batches(model_cfg, micro, count=1)[0][0]
    torch.set_num_threads(cfg.threads)
    balance = _balance(cfg, model, sample)
    profile = _profile(model, balance, sample, cfg.threads) if cfg.predict else None
    boundary = int(profile["boundary_bytes_per_sample"][-1] * micro) if profile and cfg.stages > 1 else 0
    results: dict[str, list[dict[str, Any]]] = {}
    repeat_steps: dict[str, list[float]] = {}  # per run, each repeat's median step (seconds)
    turns: dict[str, list[list[dict[str, Any]]]] = {}  # alternate: per run, every repeat's per-rank results
    with tempfile.TemporaryDirectory(prefix="gpipe-bench-") as tmp:
        for repeat in range(max(1, cfg.repeats)):  # interleaved: ours, bare, peer, single, ours, ...
            for run in runs:
                out = Path(tmp) / f"{run}{repeat}"
                out.mkdir()
                spec = worker_spec(cfg, run, model_cfg, balance, boundary, out)
                _wait_for_quiet(cfg.wait_quiet_s)
                _launch(spec, cfg.timeout)
                files = sorted(out.glob(f"{run}_rank*.json"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
                per_rank = [json.loads(p.read_text()) for p in files]
                repeat_steps.setdefault(run, []).append(_median_step(per_rank))
                if any("block_ratios" in r for r in per_rank):
                    turns.setdefault(run, []).append(per_rank)
                if run in results and not _faster(per_rank, results[run]):
                    continue
                results[run] = per_rank
                _keep_timelines(cfg, run, out)
    for run, repeats in turns.items():
        results[run] = pool_turns(results[run], repeats)
    rows = _rows(cfg, results, params, profile, balance)
    _add_paired(rows, repeat_steps)
    _append_csv(Path(str(cfg.csv)), rows)
    print(format_table(rows))
    print(format_paired(rows))
    grads = [0] * cfg.stages  # the per-micro-batch steps make each stage's gradients afresh
    for c, (a, b) in enumerate(stage_bounds(balance)):
        grads[c % cfg.stages] += sum(
            p.numel() * p.element_size() for layer in list(model)[a:b] for p in layer.parameters()
        )
    print(format_memory(rows, grads))
    return rows


def format_memory(rows: list[dict[str, Any]], step_gradient_bytes: list[int]) -> str:
    """Per run, each stage's measured peak tensor MiB next to the cost model's
    (:func:`lightning_gpipe.tools.simulate.peak_activation_memory`, backward workspace and loss side
    included) and their ratio, stage order. Under ``ours`` with a schedule other than ``gpipe`` the
    per-micro-batch steps (:mod:`lightning_gpipe.strategy.microstep`) make the step's parameter gradients
    afresh, which the meter counts: the measure is the meter less ``step_gradient_bytes`` (per
    stage), the meter's own reading after it."""
    lines = []
    for r in rows:
        measured, model = r.get("activation_bytes_stages"), r.get("predicted_activation_bytes_stages")
        if not measured or not model:
            continue
        fresh = r["run"] == "ours" and r.get("schedule") not in (None, "gpipe")
        pairs = []
        for j, (a, b) in enumerate(zip(str(measured).split("|"), str(model).split("|"))):
            meter, predicted = float(a), float(b)
            value = meter - (step_gradient_bytes[j] if fresh else 0)
            ratio = f"{value / predicted:.2f}" if predicted else "–"
            pairs.append(
                f"{value / 2**20:.1f} [meter {meter / 2**20:.1f}] "
                f"(model {predicted / 2**20:.1f}, ratio {ratio})"
            )
        lines.append(
            f"{r['run']} {_schedule_name(r)} M={r['chunks']}: peak MiB per stage: " + " | ".join(pairs)
        )
    return "\n".join(lines)


def pool_turns(kept: list[dict[str, Any]], repeats: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``kept`` (one repeat's per-rank results) with the turns' ratios of every repeat of the run
    (``alternate``): each stage's ``block_ratios`` and ``cpu_block_ratios`` are those of all
    ``repeats`` in order, and ``repeat_ratios`` the median block ratio of each repeat that timed a
    block.

    Each set of processes starts with its own memory layout, thread placement and host load, which
    moves a run's ratio by more than its pairs' interval; pooling the pairs of several sets of
    processes measures the code rather than one start of it. Each pair is still a comparison
    seconds apart within one set of processes.
    """
    pooled = []
    for result in kept:
        same = [r for rep in repeats for r in rep if r.get("stage") == result.get("stage")]
        merged = dict(result)
        for key in ("block_ratios", "cpu_block_ratios"):
            if all(key in r for r in same):
                merged[key] = [x for r in same for x in r[key]]
        merged["repeat_ratios"] = [m for r in same if (m := _median(r.get("block_ratios"))) is not None]
        pooled.append(merged)
    return pooled


def _median_step(per_rank: list[dict[str, Any]]) -> float:
    steps = [s for r in per_rank for key in ("step_s",) for s in r.get(key, [])]
    steps += [s for r in per_rank for v in r.values() if isinstance(v, dict) for s in v.get("step_s", [])]
    return statistics.median(steps) if steps else math.inf


def _faster(new: list[dict[str, Any]], old: list[dict[str, Any]]) -> bool:
    """Whether a repeat's median step is shorter than the kept one's (repeats keep the least disturbed)."""
    return _median_step(new) < _median_step(old)


def _keep_timelines(cfg: DictConfig, run: str, out: Path) -> None:
    """Copy a run's Chrome traces and Gantt charts to
    ``{csv dir}/timelines/{run}_{model}_n{N}_k{K}_m{M}_{checkpoint}.*``."""
    for name in ("timeline.png", "timeline.json", "bare_timeline.png", "bare_timeline.json"):
        if (out / name).exists():
            target = Path(str(cfg.csv)).parent / "timelines"
            target.mkdir(parents=True, exist_ok=True)
            tag = f"{run}_{cfg.model.name}_n{cfg.batch_size}_k{cfg.stages}_m{cfg.chunks}_{cfg.checkpoint}"
            if run == "ours" and cfg.schedule != "gpipe":
                tag += f"_{cfg.schedule}" + (f"_v{cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
            (target / f"{tag}{Path(name).suffix}").write_bytes((out / name).read_bytes())


def _rows(
    cfg: DictConfig,
    results: dict[str, list[dict]],
    params: int,
    profile: dict[str, list[float]] | None,
    balance: list[int],
) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for run, per_rank in results.items():
        if run == "single":
            for key, name in (
                (f"threads{cfg.threads}", "single"),
                (f"threads{cfg.stages * cfg.threads}", "single_mt"),
                (f"micro{cfg.threads}", "single_mb"),
            ):
                if key in per_rank[0] and name not in rows:
                    rows[name] = _row(cfg, name, per_rank[0][key], [per_rank[0][key]], params, [len(balance)])
            continue
        by_stage = sorted(per_rank, key=lambda r: r["stage"])
        result = dict(by_stage[-1])  # the last stage's step times
        for r in per_rank:  # the timeline summary, gathered on global rank 0
            result.update(
                {key: r[key] for key in ("bubble", "stage_bubble", "window_s", "latency_eff_s") if key in r}
            )
        rows[run] = _row(cfg, run, result, by_stage, params, balance)
    k = cfg.stages
    bare = next((r for r in results.get("bare", []) if "latency_s" in r), {})
    latency = bare.get("latency_s", 0.0)
    extra = bare.get("boundary_s", latency) - latency
    micro = microbatch_sizes(cfg.batch_size, cfg.chunks)[0]
    sizes = [b * micro for b in profile["boundary_bytes_per_sample"]] if profile else None
    bandwidth = sizes[-1] / extra if sizes and extra > 0 else math.inf
    for run in ("ours", "bare"):
        if run not in rows:
            continue
        row = rows[run]
        if bare:
            row["latency_s"], row["bandwidth_bytes_per_s"] = latency, bandwidth
            row["latency_gloo_s"] = bare.get("latency_gloo_s")
        row["predicted_window_s"] = predict_window(row, sizes)
        if row.get("latency_eff_s") is not None:  # the same, with the run's own message delay
            row["predicted_window_eff_s"] = predict_window({**row, "latency_s": row["latency_eff_s"]})
        if profile is not None:
            sim = simulate(
                k,
                cfg.chunks,
                profile["forward"],
                profile["backward"],
                schedule=row["schedule"],
                virtual_stages=row["virtual_stages"],
                checkpoint=cfg.checkpoint,
                batch_size=cfg.batch_size,
                activation_bytes=profile["activation"],
                input_bytes=profile["recomputed"],
                workspace_bytes=profile["workspace"],
                output_bytes=profile["output"][0],
                boundary_bytes=[b * micro for b in profile["boundary_bytes_per_sample"]],
            )
            assert sim.peak_activation_bytes is not None
            row["predicted_bubble"] = sim.bubble
            row["predicted_activation_bytes"] = max(sim.peak_activation_bytes)
            row["predicted_activation_bytes_stages"] = "|".join(
                str(round(b)) for b in sim.peak_activation_bytes
            )
    add_ratios(list(rows.values()))
    return [{c: row.get(c) for c in COLUMNS} for row in rows.values()]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``ideal_samples_per_s``, ``vs_ideal``, ``vs_peer`` and ``lightning_overhead`` (from median
    steps) and their ``_best`` twins (from the shortest step) in rows of one configuration.

    ideal = K·M/(M+(K-1)/v) × the single run's samples/s (same threads per process as a stage; v
    the row's virtual stages, 1 but under interleaved 1F1B: the bubble-limited speed-up);
    ``vs_ideal_mb`` takes the ideal from ``single_mb`` instead (one process on the same
    micro-batches: what is left is the schedule's own loss, not the smaller matrices' slower
    kernels). At M=1, ``single_mb`` is ``single``.
    """
    by_run = {r["run"]: r for r in rows}
    single, ours, peer, bare = (by_run.get(n) for n in ("single", "ours", "peer", "bare"))
    for suffix, key in (("", "samples_per_s"), ("_best", "samples_per_s_best")):
        for row in rows:
            if row["run"] not in ("ours", "bare", "peer"):
                continue
            k, m = int(row["stages"]), len(microbatch_sizes(int(row["batch_size"]), int(row["chunks"])))
            v = int(row.get("virtual_stages") or 1)
            for base_run, name in (("single", ""), ("single_mb" if m > 1 else "single", "_mb")):
                base = by_run.get(base_run)
                if base and base.get(key):
                    ideal = k * m / (m + (k - 1) / v) * float(base[key])
                    if not suffix:
                        row[f"ideal{name}_samples_per_s"] = ideal
                    row[f"vs_ideal{name}{suffix}"] = float(row[key]) / ideal
        if ours and peer:
            ours["vs_peer" + suffix] = float(ours[key]) / float(peer[key])
        if ours and bare:
            ours["lightning_overhead" + suffix] = float(bare[key]) / float(ours[key]) - 1


def _add_paired(rows: list[dict[str, Any]], repeat_steps: dict[str, list[float]]) -> None:
    """``vs_peer_paired`` of ``ours`` and ``bare``: the median over repeats of the peer's median step
    over the run's, each ratio taken within one repeat (the runs of a repeat follow each other, so
    a machine that slows down for a while slows both sides of a ratio alike); the per-repeat
    ratios ``|``-joined in ``vs_peer_paired_repeats``."""
    peer = repeat_steps.get("peer")
    for row in rows:
        own = repeat_steps.get(row["run"]) if row["run"] in ("ours", "bare") else None
        if peer and own:
            ratios = [p / o for o, p in zip(own, peer)]
            row["vs_peer_paired"] = statistics.median(ratios)
            row["vs_peer_paired_repeats"] = "|".join(f"{r:.3f}" for r in ratios)


def format_paired(rows: list[dict[str, Any]]) -> str:
    """One line per run with a paired ratio to the peer (:func:`_add_paired`), and one per run that
    took turns with the peer (``alternate``: the median over blocks of the peer's median step over
    the run's in the block before)."""
    lines = [
        f"{row['run']} / peer, {row['model']} {_schedule_name(row)} M={row['chunks']}, paired: "
        f"{_fmt(row.get('vs_peer_paired'), '.3f')} "
        f"(median over repeats; per repeat {str(row.get('vs_peer_paired_repeats', '')).replace('|', ', ')})"
        for row in rows
        if row.get("vs_peer_paired") not in (None, "")
    ]
    lines += [
        f"{row['run']} / peer{_peer_schedule(row)}, {row['model']} {_schedule_name(row)} "
        f"M={row['chunks']}, alternating: {_fmt(row.get('vs_peer_alternating'), '.3f')} "
        f"(median over {len(str(row.get('vs_peer_alternating_blocks', '')).split('|'))} blocks"
        f"{_over_repeats(row)}, its 95 % interval "
        f"{str(row.get('vs_peer_alternating_ci') or '–').replace('|', '–')}; "
        f"per block {str(row.get('vs_peer_alternating_blocks', '')).replace('|', ', ')}; "
        "CPU per step, the peer's over ours, by stage: "
        f"{str(row.get('vs_peer_alternating_cpu_stages') or '–').replace('|', ', ')})"
        for row in rows
        if row.get("vs_peer_alternating") not in (None, "")
    ]
    lines += [
        f"one-way latency of a 1-element message by ping-pong (bare): lightning_gpipe.transport.p2p.P2P "
        f"{_fmt(row['latency_s'], '.0f', 1e6)} us, torch.distributed isend/irecv "
        f"{_fmt(row.get('latency_gloo_s'), '.0f', 1e6)} us"
        for row in rows
        if row["run"] == "bare" and row.get("latency_s") not in (None, "")
    ]
    return "\n".join(lines)


def _over_repeats(row: dict[str, Any]) -> str:
    """`` of R sets of processes (each one's median: …)`` where a row pools repeats, else nothing."""
    repeats = str(row.get("vs_peer_alternating_repeats") or "")
    if not repeats:
        return ""
    medians = repeats.replace("|", ", ")
    return f" of {len(repeats.split('|'))} sets of processes (each one's median: {medians})"


def _append_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append ``rows``; to a CSV of an earlier version, under its own header (newer columns left out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    columns = COLUMNS if new else next(csv.reader(path.open()))
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _fmt(value: Any, spec: str = ".3g", scale: float = 1.0) -> str:
    if value in (None, ""):
        return "–"
    return format(float(value) * scale, spec)


def _peer_schedule(row: dict[str, Any]) -> str:
    """`` (1f1b)`` where the peer ran another schedule than the row (``peer_schedule``), else empty."""
    other = row.get("peer_schedule")
    return f" ({other})" if other and other != row.get("schedule") else ""


def _schedule_name(row: dict[str, Any]) -> str:
    """``gpipe``, ``1f1b``, ``interleaved_1f1b v=2``; ``–`` for the one-process runs."""
    if not row.get("schedule"):
        return "–"
    v = int(row.get("virtual_stages") or 1)
    return str(row["schedule"]) + (f" v={v}" if v > 1 else "")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of benchmark rows: throughput and ratios from the median step (and from the
    shortest step, in parentheses), the ideal K·M/(M+(K-1)/v) × one stage's samples/s, the measured
    bubble of the pipeline (against the schedule's ideal) and of each stage (stage order), step
    window against the cost model, memory."""
    head = (
        "| run | schedule | K | M | checkpoint | samples/s | ideal samples/s | vs ideal "
        "| vs ideal, same micro-batches | vs peer | Lightning overhead | bubble (ideal) "
        "| bubble per stage | window ms (model) | act. MiB (model) "
        "| RSS MiB |"
    )
    lines = [head, "|" + "---|" * 16]

    def pair(key: str, spec: str) -> str:
        best = r.get(key + "_best") if key != "samples_per_s" else r.get("samples_per_s_best")
        return f"{_fmt(r.get(key), spec)} ({_fmt(best, spec)})" if r.get(key) not in (None, "") else "–"

    for r in rows:
        stages = str(r["bubble_stages"]).split("|") if r.get("bubble_stages") else []
        per_stage = " / ".join(_fmt(b, ".2f") for b in stages) if stages else "–"
        lines.append(
            f"| {r['run']} | {_schedule_name(r)} | {r['stages']} | {r['chunks']} | {r['checkpoint']} "
            f"| {pair('samples_per_s', '.0f')} | {_fmt(r.get('ideal_samples_per_s'), '.0f')} "
            f"| {pair('vs_ideal', '.2f')} | {pair('vs_ideal_mb', '.2f')} | {pair('vs_peer', '.2f')} "
            f"| {pair('lightning_overhead', '+.1%')} "
            f"| {_fmt(r['bubble'], '.2f')} ({_fmt(r['bubble_ideal'], '.2f')}) "
            f"| {per_stage} "
            f"| {_fmt(r['window_s'], '.1f', 1e3)} ({_fmt(r['predicted_window_s'], '.1f', 1e3)}) "
            f"| {_fmt(r['activation_bytes'], '.1f', 2**-20)} "
            f"({_fmt(r['predicted_activation_bytes'], '.1f', 2**-20)}) "
            f"| {_fmt(r['rss_bytes'], '.0f', 2**-20)} |"
        )
    return "\n".join(lines)


# -- capacity --------------------------------------------------------------------------------------


def _step_need(cfg: DictConfig, num_layers: int, checkpoint: str) -> tuple[int, int]:
    """Bytes one training step of a one-stage pipeline needs, and the parameter count."""
    from lightning_gpipe.engine.stage import PipelineStage
    from lightning_gpipe.transport.layout import StageTopology
    from lightning_gpipe.transport.p2p import P2P

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_cfg, dict)
    model_cfg["num_layers"] = num_layers
    device = torch.device(cfg.capacity.device)
    model = build_model(model_cfg).to(device)
    stage = PipelineStage(
        list(model.named_children()),
        StageTopology(0, 1, None, None),
        cfg.chunks,
        checkpoint,
        P2P(device),
    )
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    loss = loss_fn(model_cfg)
    x, y = (t.to(device) for t in make_batches(model_cfg, cfg.batch_size, count=1)[0])

    def step() -> None:
        stage.begin_step(True)
        try:
            out = stage(x)
        finally:
            stage.end_step()
        loss(out, y).backward()
        stage.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # gradients and optimizer state exist from here on
    params = sum(p.numel() for p in stage.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), params
    held = sum(p.numel() * p.element_size() * 2 for p in stage.parameters())  # parameters + gradients
    held += sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    with TensorMemoryMeter() as meter:
        step()
    return held + meter.peak, params


def capacity(cfg: DictConfig) -> list[dict[str, Any]]:
    """Largest ``model.num_layers`` whose one-stage training step fits the budget, per checkpoint mode.

    Doubling from 1 layer, then bisection; each trial runs two steps of a fresh model. Returns one row
    per mode: ``checkpoint``, ``num_layers`` (0: not even one layer fits), ``params``, ``need_bytes``
    (at that size), ``budget_bytes``; prints them with the ratio to the first mode and appends them
    to ``capacity.csv`` beside ``cfg.csv``.
    """
    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.capacity.device)
    budget = cfg.capacity.budget_bytes
    if budget is None:
        if device.type != "cuda":
            raise ValueError("capacity.budget_bytes is required on CPU (bytes, e.g. 268435456)")
        budget = torch.cuda.get_device_properties(device).total_memory
    rows = []
    for checkpoint in cfg.capacity.checkpoints:
        trials: dict[int, tuple[int, int]] = {}

        def fits(n: int, checkpoint: str = checkpoint, trials: dict = trials) -> bool:
            trials[n] = _step_need(cfg, n, checkpoint)
            print(
                f"capacity: checkpoint={checkpoint} num_layers={n}: {trials[n][0] / 2**20:.1f} MiB",
                flush=True,
            )
            return trials[n][0] <= budget

        lo, n = 0, 1
        while n <= cfg.capacity.max_layers and fits(n):
            lo, n = n, n * 2
        hi = min(n, cfg.capacity.max_layers + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        need, params = trials.get(lo, (0, 0))
        rows.append(
            {
                "checkpoint": checkpoint,
                "num_layers": lo,
                "params": params,
                "need_bytes": need,
                "budget_bytes": budget,
                "device": device.type,
            }
        )
    path = Path(str(cfg.csv)).with_name("capacity.csv") if cfg.csv else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["model", "batch_size", "chunks", *rows[0]])
            if new:
                writer.writeheader()
            for r in rows:
                writer.writerow(
                    {"model": cfg.model.name, "batch_size": cfg.batch_size, "chunks": cfg.chunks, **r}
                )
    first = rows[0]["num_layers"] or 1
    print("| checkpoint | largest num_layers | parameters | need MiB | budget MiB | vs first |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['num_layers']} | {r['params'] / 1e6:.2f} M "
            f"| {r['need_bytes'] / 2**20:.1f} "
            f"| {r['budget_bytes'] / 2**20:.0f} | {r['num_layers'] / first:.2f}× |"
        )
    return rows


# -- report ------------------------------------------------------------------------------------------


def _least_disturbed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration and run: where a CSV holds several invocations of the same one, the
    row with the shortest step (least disturbed on a shared machine); ratios are recomputed."""
    config = ("model", "num_layers", "width", "stages", "chunks", "checkpoint", "batch_size", "balance")
    kept: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        schedule = (r.get("schedule") or "gpipe", r.get("virtual_stages") or "1")
        key = (*(r[c] for c in config if r["run"] not in SINGLES or c != "stages"), *schedule, r["run"])
        if key not in kept or float(r["samples_per_s_best"]) > float(kept[key]["samples_per_s_best"]):
            kept[key] = dict(r)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in kept.values():
        groups.setdefault(tuple(r[c] for c in config if c not in ("stages", "balance")), []).append(r)
    for group in groups.values():
        singles = [r for r in group if r["run"] in SINGLES]
        pipelines = [r for r in group if r not in singles]
        for setting in {_setting(r) for r in pipelines}:  # K and the schedule: one ours, bare, peer each
            add_ratios([r for r in pipelines if _setting(r) == setting] + singles)
    return list(kept.values())


def _setting(row: dict[str, Any]) -> tuple[str, str, str]:
    """A pipeline row's K, schedule and v (CSV rows before the schedule columns: gpipe, 1)."""
    return (str(row["stages"]), str(row.get("schedule") or "gpipe"), str(row.get("virtual_stages") or 1))


def report(path: str | Path) -> str:
    """Tables of a benchmark CSV: every row (the least disturbed invocation of each), then per
    (K, checkpoint) the M sweep normalized to M=1 and the cost model's error."""
    rows = _least_disturbed(list(csv.DictReader(Path(path).open())))
    parts = [format_table(rows), format_paired(rows)]
    groups: dict[tuple[str, str, str, str, int], dict[int, dict[str, dict]]] = {}
    for r in rows:
        if r["run"] in SINGLES:
            continue
        v = int(r.get("virtual_stages") or 1)
        key = (r["model"], r["stages"], r["checkpoint"], r.get("schedule") or "gpipe", v)
        groups.setdefault(key, {}).setdefault(int(r["chunks"]), {})[r["run"]] = r
    for (model, k, checkpoint, schedule, v), by_m in sorted(groups.items()):
        if 1 not in by_m:
            continue
        stages = int(k)
        name = schedule + (f" v={v}" if v > 1 else "")
        lines = [
            f"\n{model}, K={stages}, checkpoint={checkpoint}, schedule={name}: "
            "samples/s normalized to the same run at M=1 (median step; shortest step in parentheses)",
            "| M | ideal K·M/(M+(K-1)/v) | ours | bare | peer | GPipe Table 2 (Transformer, K=2) |",
            "|---|---|---|---|---|---|",
        ]
        for m, runs in sorted(by_m.items()):
            cells = []
            for run in ("ours", "bare", "peer"):
                r, base = runs.get(run), by_m[1].get(run)
                if r and base:
                    median = float(r["samples_per_s"]) / float(base["samples_per_s"])
                    best = float(r["samples_per_s_best"]) / float(base["samples_per_s_best"])
                    cells.append(f"{median:.2f} ({best:.2f})")
                else:
                    cells.append("–")
            gpipe = GPIPE_TABLE2_K2.get(m) if stages == 2 else None
            ideal = stages * m / (m + (stages - 1) / v)  # in units of the one-stage throughput
            lines.append(f"| {m} | {ideal:.2f} | " + " | ".join(cells) + f" | {gpipe if gpipe else '–'} |")
        model_rows = [
            (m, runs[run]) for m, runs in sorted(by_m.items()) for run in ("ours", "bare") if run in runs
        ]
        model_rows = [(m, r) for m, r in model_rows if r.get("predicted_window_s")]
        if model_rows:
            lines += [
                "\nCost model (lightning_gpipe.tools.simulate fed with the run's own per-stage span "
                "medians and the measured P2P latency) against the measured step window (median)",
                "| M | run | measured ms | predicted ms (ping-pong latency) | error "
                "| predicted ms (in-run message delay) | error |",
                "|---|---|---|---|---|---|---|",
            ]
            for m, r in model_rows:
                measured, predicted = float(r["window_s"]), float(r["predicted_window_s"])
                eff = float(r["predicted_window_eff_s"]) if r.get("predicted_window_eff_s") else None
                eff_cells = f"{eff * 1e3:.1f} | {eff / measured - 1:+.1%}" if eff else "– | –"
                lines.append(
                    f"| {m} | {r['run']} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} "
                    f"| {predicted / measured - 1:+.1%} | {eff_cells} |"
                )
        parts.append("\n".join(lines))
    return "\n".join(parts)


@hydra.main(version_base="1.3", config_path="conf", config_name="benchmark")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry: the mode's result; for ``throughput``, ours' samples/s (what a sweeper maximizes)."""
    if cfg.mode == "capacity":
        capacity(cfg)
        return None
    if cfg.mode == "report":
        print(report(cfg.csv))
        return None
    if cfg.mode == "spec":
        write_spec(cfg)
        return None
    rows = benchmark(cfg)
    ours = next((r for r in rows if r["run"] == "ours"), None)
    return ours["samples_per_s"] if ours else None


if __name__ == "__main__":
    main()
