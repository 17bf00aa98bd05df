"""Pipeline × data parallel × tensor parallel at 4 processes against Lightning's ``ModelParallelStrategy``.

One Llama-style model (:func:`benchmarks.workloads.build_llama`: RMSNorm, attention q/k/v/o, SwiGLU
MLP per block, in one ``nn.Sequential``), fp32, Adam, the same global batch in every row (issue 42,
item 5). Rows:

- ``single``: the plain model under a one-device Lightning ``Trainer``, the reference;
- ``pp2_dp2``: ``GPipeStrategy(pipeline_parallel_size=2, data_parallel_size=2)``, replicated stages;
- ``pp2_fsdp2``: the same with ``data_parallel="fsdp"`` (each stage FSDP2-sharded over its replicas);
- ``pp2_tp2``: ``GPipeStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)``, every block of a
  stage under :data:`benchmarks.workloads.LLAMA_BLOCK_PLAN` in ``parallelize_stage``;
- ``mps_fsdp4``: Lightning's ``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)``,
  ``fully_shard`` per block, then the whole, in ``configure_model``;
- ``mps_tp4``: ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=4)``,
  ``parallelize_module`` per block with the same plan in ``configure_model``.

Every model is built on the meta device and materialized by the strategy: under ``GPipeStrategy``
each rank its stage only (``balance="parameters"``), under ``ModelParallelStrategy`` each rank its
shard after ``configure_model``. The data loader's batch is the global batch over the data-parallel
size D (Lightning's ``DistributedSampler`` splits the data over D), so every row trains on the same
samples per step.

Per row: samples/s (the global batch over the median step, the step's time being the slowest rank's,
after ``--warmup`` steps), per rank the peak memory (CPU: growth of the resident set's peak, ``VmHWM``,
from just before ``fit``, as :mod:`benchmarks.capacity` measures it, with glibc's mmap threshold fixed
at ``--mmap-threshold`` so that a freed block of FSDP's all-gathers or of the gradients goes back to
the system and the peak follows what is alive rather than what glibc's heap kept; CUDA:
``torch.cuda.max_memory_allocated``) and the bytes of parameters and of Adam's state it holds at the
end of training (a ``DTensor``'s local shard). ``state_vs_single`` is the largest rank's parameters
plus optimizer state over the one-process figure (3 × 4 bytes a parameter).

Commands, from the repository root (``--small``: tiny sizes, the code paths in seconds)::

    python -m benchmarks.mesh --device cpu
    python -m benchmarks.mesh --device cpu --small --rows single pp2_tp2
    python -m benchmarks.mesh --device cuda        # 4 ranks need 4 GPUs (NCCL: one GPU per rank)

Writes ``mesh.csv``, ``mesh.md`` and ``mesh.json`` (every rank's record per row) under ``--out``
(default: ``$OUT`` if set, else ``benchmarks/results/mesh``) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.capacity import MIB, ROOT, fit_and_record

SIZES: dict[str, dict[str, int]] = {
    "cpu": {"vocab": 256, "dim": 512, "heads": 8, "hidden": 1408, "depth": 16, "seq_len": 32, "batch": 16},
    "cuda": {
        "vocab": 32000,
        "dim": 2048,
        "heads": 16,
        "hidden": 5632,
        "depth": 8,
        "seq_len": 512,
        "batch": 16,
    },
    "small": {"vocab": 64, "dim": 32, "heads": 4, "hidden": 64, "depth": 4, "seq_len": 8, "batch": 8},
}

# row: (strategy, pipeline K, data-parallel D, tensor-parallel T, data_parallel)
ROWS: dict[str, tuple[str, int, int, int, str]] = {
    "single": ("single", 1, 1, 1, "replicate"),
    "pp2_dp2": ("gpipe", 2, 2, 1, "replicate"),
    "pp2_fsdp2": ("gpipe", 2, 2, 1, "fsdp"),
    "pp2_tp2": ("gpipe", 2, 1, 2, "replicate"),
    "mps_fsdp4": ("model_parallel", 1, 4, 1, "fsdp"),
    "mps_tp4": ("model_parallel", 1, 1, 4, "replicate"),
}

LABELS = {
    "single": "one process",
    "pp2_dp2": "ours PP2 × DP2 (replicate)",
    "pp2_fsdp2": "ours PP2 × FSDP2",
    "pp2_tp2": "ours PP2 × TP2",
    "mps_fsdp4": "ModelParallelStrategy FSDP2 × 4",
    "mps_tp4": "ModelParallelStrategy TP × 4",
}


# -- one training job (every rank runs this) ------------------------------------------------------


def _trial(spec: dict[str, Any]) -> None:
    """Train ``spec["steps"]`` steps of ``spec["row"]``; each rank writes ``rank{r}.json``."""
    import pytorch_lightning as pl
    import torch.nn.functional as F
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gpipe
    from benchmarks.workloads import LLAMA_BLOCK_PLAN, LlamaBlock, build_llama

    torch.set_num_threads(spec.get("threads", 1))
    device, size, steps = spec["device"], dict(spec["size"]), spec["steps"]
    kind, k, d, t, data_parallel = ROWS[spec["row"]]
    vocab, batch, seq_len = size["vocab"], size["batch"], size["seq_len"]
    dims = {key: size[key] for key in ("vocab", "dim", "heads", "hidden", "depth")}

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: torch.nn.Sequential | None = None

        def configure_model(self) -> None:
            if self.layers is not None:
                return
            if kind != "model_parallel":  # the strategy's init context: the device (single) or meta
                self.layers = build_llama(**dims)  # (gpipe: each rank materializes its stage only)
                return
            with torch.device("meta"):  # Lightning materializes the shards after this hook
                self.layers = build_llama(**dims)
            mesh = self.device_mesh
            blocks = [m for m in self.layers if isinstance(m, LlamaBlock)]
            if d > 1:
                for block in blocks:
                    fully_shard(block, mesh=mesh["data_parallel"])
                fully_shard(self.layers, mesh=mesh["data_parallel"])
            else:
                for block in blocks:
                    parallelize_module(block, mesh["tensor_parallel"], LLAMA_BLOCK_PLAN)

        def parallelize_stage(self, stage: torch.nn.Module, tp_mesh: Any) -> None:
            for layer in stage.children():
                if isinstance(layer, LlamaBlock):
                    parallelize_module(layer, tp_mesh, LLAMA_BLOCK_PLAN)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (ids,) = batch
            assert self.layers is not None
            logits = self.layers(ids[:, :-1])
            return F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Meter(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.times: list[float] = []
            self.held: dict[str, int] = {}

        def _sync(self) -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._sync()
            self.starts.append(time.perf_counter())

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._sync()
            self.times.append(time.perf_counter() - self.starts[-1])

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            optimizer = trainer.optimizers[0]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.held = {
                "param_bytes": sum(local(p).numel() * p.element_size() for p in params),
                "optimizer_bytes": sum(local(v).numel() * v.element_size() for v in state if v.dim()),
            }

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * steps, seq_len + 1), generator=g)
    data = DataLoader(TensorDataset(ids), batch_size=batch // d)
    common = dict(
        accelerator="gpu" if device == "cuda" else "cpu",
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision="32-true",
    )
    strategy: Any
    if kind == "single":
        strategy, devices = "auto", 1
    elif kind == "gpipe":
        strategy = lightning_gpipe.GPipeStrategy(
            pipeline_parallel_size=k,
            data_parallel_size=d,
            tensor_parallel_size=t,
            data_parallel=data_parallel,
            chunks=spec["chunks"],
            schedule=spec["schedule"],
            balance="parameters",
        )
        devices = k * d * t
    else:
        strategy, devices = ModelParallelStrategy(data_parallel_size=d, tensor_parallel_size=t), d * t
    meter = Meter()
    trainer = pl.Trainer(strategy=strategy, devices=devices, callbacks=[meter], **common)
    fit_and_record(trainer, LM(), data, device, spec["out"], lambda: {"step_s": meter.times, **meter.held})


# -- the driver --------------------------------------------------------------------------------------


def run_row(spec: dict[str, Any], work: Path, timeout: float) -> tuple[list[dict[str, Any]] | None, str]:
    """One row in fresh processes: every rank's record and ``""``, or None and why it failed."""
    from lightning_gpipe.tools.launch import JobTimeout, job_env, run_job

    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.json"):
        old.unlink()
    spec = dict(spec, out=str(work))
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "benchmarks.mesh", "trial", str(path)]
    threshold = spec.get("mmap_threshold", 0)
    extra = {"MALLOC_MMAP_THRESHOLD_": str(threshold)} if threshold and spec["device"] == "cpu" else {}
    try:
        ((code, output),) = run_job(
            command, env=job_env(threads=spec["threads"], extra=extra), cwd=ROOT, timeout=timeout
        )
    except JobTimeout:
        return None, f"timed out after {timeout:.0f} s"
    _, k, d, t, _ = ROWS[spec["row"]]
    records = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if len(records) != k * d * t or any(r["error"] for r in records) or code != 0:
        reason = next((r["error"] for r in records if r["error"]), f"exit code {code}")
        lines = [line for line in output.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        print(f"  {spec['row']} failed ({reason}); last output:\n{output[-2000:]}", flush=True)
        return None, f"{reason}: {last.strip()[:200]}"
    return sorted(records, key=lambda r: r["rank"]), ""


def parameters(size: dict[str, int]) -> int:
    """The model's parameter count at ``size``."""
    from benchmarks.workloads import build_llama

    with torch.device("meta"):
        model = build_llama(**{key: size[key] for key in ("vocab", "dim", "heads", "hidden", "depth")})
    return sum(p.numel() for p in model.parameters())


def table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of ``args.rows``, one after another; the table written after each."""
    size = SIZES["small" if args.small else args.device]
    whole_state = 3 * 4 * parameters(size)  # fp32 parameters and Adam's two moments, one process
    rows: list[dict[str, Any]] = []
    raw: dict[str, list[dict[str, Any]] | None] = {}
    for name in args.rows:
        kind, k, d, t, data_parallel = ROWS[name]
        spec = {
            "row": name,
            "device": args.device,
            "size": size,
            "steps": args.warmup + args.timed,
            "chunks": args.chunks,
            "schedule": args.schedule,
            "threads": args.threads,
            "mmap_threshold": args.mmap_threshold,
        }
        print(f"== {name}: {LABELS[name]}", flush=True)
        records, error = run_row(spec, Path(args.out) / "work" / name, args.timeout)
        row: dict[str, Any] = {
            "row": name,
            "strategy": LABELS[name],
            "mesh": f"{k}×{d}×{t}",
            "processes": k * d * t,
        }
        raw[name] = records
        if records is None:
            rows.append({**row, "error": error})
        else:
            steps = [max(r["step_s"][i] for r in records) for i in range(args.warmup, spec["steps"])]
            step = statistics.median(steps)
            state = [r["param_bytes"] + r["optimizer_bytes"] for r in records]
            rows.append(
                {
                    **row,
                    "samples_per_s": round(size["batch"] / step, 2),
                    "step_ms": round(1000 * step, 1),
                    "peak_mib_per_rank": ", ".join(f"{r['peak_bytes'] / MIB:.0f}" for r in records),
                    "peak_mib_max": round(max(r["peak_bytes"] for r in records) / MIB),
                    "params_mib_per_rank": ", ".join(f"{r['param_bytes'] / MIB:.1f}" for r in records),
                    "optimizer_mib_per_rank": ", ".join(f"{r['optimizer_bytes'] / MIB:.1f}" for r in records),
                    "state_mib_max": round(max(state) / MIB, 1),
                    "state_vs_single": round(max(state) / whole_state, 3),
                    "error": "",
                }
            )
        _write(args, size, rows)  # after every row: a run cut short keeps the rows it finished
        (Path(args.out) / "mesh.json").write_text(json.dumps(raw))
    print((Path(args.out) / "mesh.md").read_text(), flush=True)
    return rows


COLUMNS = [
    "row",
    "strategy",
    "mesh",
    "processes",
    "samples_per_s",
    "step_ms",
    "peak_mib_per_rank",
    "peak_mib_max",
    "params_mib_per_rank",
    "optimizer_mib_per_rank",
    "state_mib_max",
    "state_vs_single",
    "error",
]


def _write(args: argparse.Namespace, size: dict[str, int], rows: list[dict[str, Any]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "mesh.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    memory = "max_memory_allocated" if args.device == "cuda" else "peak RSS growth over fit"
    if args.device == "cpu" and args.mmap_threshold:
        memory += f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
    lines = [
        f"mesh: {args.device}, Llama-style {size['depth']} blocks, dim={size['dim']} hidden={size['hidden']} "
        f"heads={size['heads']} vocab={size['vocab']} seq_len={size['seq_len']}, "
        f"{parameters(size) / 1e6:.1f} M parameters; global batch {size['batch']}, fp32, Adam; "
        f"ours: {args.schedule}, M={args.chunks}; median of {args.timed} steps after {args.warmup}; "
        f"peak = {memory}; K×D×T",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / "mesh.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trial"]:
        _trial(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes: check the code paths")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="default: all")
    parser.add_argument("--chunks", type=int, default=4, help="ours: micro-batches M (default: 4)")
    parser.add_argument("--schedule", default="gpipe", help="ours: the schedule (default: gpipe)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=128 * 1024,
        help="CPU: glibc's MALLOC_MMAP_THRESHOLD_ in bytes for every rank (default: 131072; 0: glibc's "
        "own, which rises as large blocks are freed and leaves them in the heap, counted in the peak RSS)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per row")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/results/mesh"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "mesh.py --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
        )
    if args.device == "cuda":
        needed = max(k * d * t for _, k, d, t, _ in (ROWS[r] for r in args.rows))
        if torch.cuda.device_count() < needed:
            raise SystemExit(
                f"mesh.py --device cuda: rows {args.rows} need {needed} GPUs (NCCL: one per rank), "
                f"{torch.cuda.device_count()} visible; run --rows single on one GPU"
            )
    table(args)


if __name__ == "__main__":
    main()
