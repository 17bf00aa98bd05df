"""Capacity (GPipe Table 1): the largest Transformer that trains under a per-rank memory budget.

Rows: ``naive`` (Naive-1: a plain one-device Lightning Trainer, no pipeline, no recompute) and
``K × checkpoint`` under the gpipe strategy (``1:always`` is Pipeline-1: one stage, M
micro-batches, recompute; ``2:never`` / ``2:always``: two stages, one process each). Under the
strategy the model is built on the meta device (its layers in ``configure_model``) and every rank
materializes only its own stage, so a rank holds about 1/K of the parameters, gradients and Adam
state plus its activations.

What a rank needs is measured while it trains two steps (fp32, Adam): on CPU the growth of its
peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) from just before
``fit``; on CUDA ``torch.cuda.max_memory_allocated``. A size fits when every rank stays within
the budget. Need grows linearly in the number of blocks L, so each row measures L = 2 and 4,
predicts the largest L from the line and checks it (and its neighbours) by measuring.

``overhead`` times one stage with M micro-batches with and without recompute: recompute's time
overhead (GPipe section 2.3 puts it near 1/3 of the step, one extra forward).

Commands, from the repository root (``--small``: tiny sizes, to check the code paths in seconds)::

    python -m benchmarks.capacity table --device cpu --budget-mib 1024 --out benchmarks/results/capacity_cpu
    python -m benchmarks.capacity table --device cuda --rows naive 1:always --budget-mib 8192
    python -m benchmarks.capacity overhead --device cuda --chunks 8

Each command writes ``<command>.csv`` and ``<command>.md`` under ``--out`` (default: ``$OUT``
if set, else ``benchmarks/results/capacity``) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20

# Model sizes (recipes/models/transformer.py) and batch, per --device, and with --small.
SIZES: dict[str, dict[str, Any]] = {
    "cpu": {"vocab_size": 256, "d_model": 512, "num_heads": 8, "d_ff": 2048, "seq_len": 128, "batch": 16},
    "cuda": {"vocab_size": 32000, "d_model": 2048, "num_heads": 16, "d_ff": 8192, "seq_len": 512, "batch": 8},
    "small": {"vocab_size": 64, "d_model": 64, "num_heads": 4, "d_ff": 128, "seq_len": 16, "batch": 4},
}


# -- one training job (every rank runs this) ------------------------------------------------------


def _trial(spec: dict[str, Any]) -> None:
    """Train ``spec["steps"]`` steps; each rank writes ``rank{r}.json`` with its peak and step times."""
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from pytorch_lightning.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gpipe
    from recipes.models.transformer import build_transformer

    torch.set_num_threads(spec.get("threads", 1))
    device = spec["device"]
    size = dict(spec["size"])
    batch, steps = size.pop("batch"), spec["steps"]

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: torch.nn.Sequential | None = None

        def configure_model(self) -> None:
            if self.layers is None:
                self.layers = build_transformer(num_layers=spec["num_layers"], **size)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            assert self.layers is not None
            return F.cross_entropy(self.layers(x).flatten(0, 1).float(), y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Meter(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.times: list[float] = []

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
            self.params = sum(p.numel() for p in pl_module.parameters())

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size["vocab_size"], (batch * steps, size["seq_len"] + 1), generator=g)
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch)
    common = dict(
        accelerator="gpu" if device == "cuda" else "cpu",
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision=spec.get("precision", "32-true"),
    )
    meter = Meter()
    if spec["stages"] == 0:  # Naive-1: the plain Lightning Trainer
        trainer = pl.Trainer(devices=1, callbacks=[meter], **common)
    else:
        strategy = lightning_gpipe.GPipeStrategy(
            chunks=spec["chunks"], checkpoint=spec["checkpoint"], balance="parameters"
        )
        trainer = pl.Trainer(strategy=strategy, devices=spec["stages"], callbacks=[meter], **common)
    fit_and_record(
        trainer, LM(), data, device, spec["out"],
        lambda: {"params": getattr(meter, "params", None), "step_s": meter.times},
    )  # fmt: skip


def fit_and_record(
    trainer: Any, module: Any, data: Any, device: str, out: str, extra: Callable[[], dict[str, Any]]
) -> None:
    """Fit ``module`` on ``data`` with ``trainer`` and write this rank's record to ``out/rank{r}.json``:
    its peak memory from just before ``fit`` (CUDA: the allocator's peak; CPU: the peak resident set above
    the one then), the out-of-memory error if any, and ``extra()``, read after ``fit``.

    Raises:
        SystemExit: (code 3) ``fit`` ran out of memory; the record is written first.
    """
    import torch  # in the trial's process only, as above

    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    baseline = _rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        trainer.fit(module, data)
    except torch.OutOfMemoryError as err:
        error = f"out of memory: {str(err).splitlines()[0]}"
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _peak_rss_bytes() - baseline
    record = {"rank": trainer.global_rank, "peak_bytes": peak, "error": error, **extra()}
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if error is not None:
        raise SystemExit(3)


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak_rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


# -- the driver --------------------------------------------------------------------------------------


def run_trial(spec: dict[str, Any], work: Path, timeout: float) -> list[dict[str, Any]] | None:
    """One job in fresh processes (``stages`` of them, 1 for Naive-1); every rank's record, or None
    if it failed."""
    from lightning_gpipe.tools.launch import JobTimeout, job_env, run_job

    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.json"):
        old.unlink()
    spec = dict(spec, out=str(work))
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    env = job_env(threads=spec.get("threads", 1))
    # run from the checkout as a module: its packages (lightning_gpipe, recipes, benchmarks) import
    # from the working directory, and Lightning's launcher starts the other ranks the same way
    command = [sys.executable, "-m", "benchmarks.capacity", "trial", str(path)]
    try:
        ((code, output),) = run_job(command, env=env, cwd=ROOT, timeout=timeout)
    except JobTimeout:
        print(f"  trial timed out after {timeout} s", flush=True)
        return None
    ranks = max(spec["stages"], 1)
    records = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if len(records) != ranks or any(r["error"] for r in records):
        reason = next((r["error"] for r in records if r["error"]), f"exit code {code}")
        print(f"  trial failed ({reason}); last output:\n{output[-1500:]}", flush=True)
        return None
    return records


def _row_spec(row: str, args: argparse.Namespace) -> dict[str, Any]:
    size = SIZES["small" if args.small else args.device]
    if row == "naive":
        stages, checkpoint = 0, "never"
    else:
        k, _, checkpoint = row.partition(":")
        stages = int(k)
    return {
        "device": args.device,
        "size": size,
        "stages": stages,
        "checkpoint": checkpoint,
        "chunks": args.chunks,
        "steps": 2,
        "threads": args.threads,
    }


def table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The largest ``num_layers`` per row whose every rank stays within ``--budget-mib``."""
    budget = args.budget_mib * MIB
    rows = []
    for row in args.rows:
        spec = _row_spec(row, args)
        need: dict[int, int | None] = {}

        def measure(
            layers: int, spec: dict[str, Any] = spec, need: dict = need, row: str = row
        ) -> int | None:
            if layers not in need:
                records = run_trial(
                    dict(spec, num_layers=layers),
                    Path(args.out) / "work" / row.replace(":", "_"),
                    args.timeout,
                )
                need[layers] = None if records is None else max(r["peak_bytes"] for r in records)
                shown = "failed" if need[layers] is None else f"{need[layers] / MIB:.0f} MiB per rank (max)"
                print(f"{row}: num_layers={layers}: {shown}", flush=True)
            return need[layers]

        def fits(layers: int) -> bool:
            value = measure(layers)
            return value is not None and value <= budget

        a, b = measure(2), measure(4)
        if a is None or b is None or b <= a:
            guess = 2
        else:
            slope = (b - a) / 2
            guess = max(1, int((budget - (a - 2 * slope)) // slope))
        guess = min(guess, args.max_layers)
        largest = 0
        if fits(guess):
            largest = guess
            while largest < args.max_layers and fits(largest + 1):
                largest += 1
        else:
            trial = guess - 1
            while trial >= 1 and not fits(trial):
                trial -= 1
            largest = max(trial, 0)
        params = _params(spec["size"], largest) if largest else 0
        rows.append(
            {
                "row": "Naive-1" if row == "naive" else f"Pipeline-{spec['stages']} ({spec['checkpoint']})",
                "stages": max(spec["stages"], 1),
                "checkpoint": spec["checkpoint"],
                "chunks": 1 if row == "naive" else spec["chunks"],
                "num_layers": largest,
                "params_m": round(params / 1e6, 1),
                "need_mib": round((need.get(largest) or 0) / MIB),
                "budget_mib": args.budget_mib,
                "device": args.device,
            }
        )
        first = rows[0]["params_m"] or 1.0
        for r in rows:
            r["vs_first"] = round(r["params_m"] / first, 2)
        _write(args, "table", rows)  # after every row: a run cut short keeps the rows it finished
    return rows


def _params(size: dict[str, Any], layers: int) -> int:
    import torch

    from recipes.models.transformer import build_transformer

    sizes = {k: v for k, v in size.items() if k != "batch"}
    with torch.device("meta"):
        return sum(p.numel() for p in build_transformer(num_layers=layers, **sizes).parameters())


def overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median step time of one stage, M = ``--chunks``, without and with recompute."""
    rows = []
    for checkpoint in ("never", "always"):
        spec = dict(
            _row_spec(f"1:{checkpoint}", args), num_layers=args.layers, steps=args.warmup + args.timed
        )
        records = run_trial(spec, Path(args.out) / "work" / f"overhead_{checkpoint}", args.timeout)
        if records is None:
            rows.append(
                {"checkpoint": checkpoint, "chunks": args.chunks, "num_layers": args.layers, "step_ms": None}
            )
            continue
        times = records[0]["step_s"][args.warmup :]
        rows.append(
            {
                "checkpoint": checkpoint,
                "chunks": args.chunks,
                "num_layers": args.layers,
                "step_ms": round(1000 * statistics.median(times), 2),
                "need_mib": round(records[0]["peak_bytes"] / MIB),
                "device": args.device,
            }
        )
    never = rows[0]["step_ms"]
    for r in rows:
        r["overhead"] = round(r["step_ms"] / never - 1, 3) if r["step_ms"] and never else None
    _write(args, "overhead", rows)
    return rows


def _write(args: argparse.Namespace, name: str, rows: list[dict[str, Any]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (out / f"{name}.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    size = SIZES["small" if args.small else args.device]
    lines = [
        f"{name}: {args.device}, Transformer d_model={size['d_model']} d_ff={size['d_ff']} "
        f"heads={size['num_heads']} "
        f"vocab={size['vocab_size']} seq_len={size['seq_len']} batch={size['batch']}, fp32, Adam"
        + (f", budget {args.budget_mib} MiB per rank" if name == "table" else ""),
        "",
        "| " + " | ".join(fields) + " |",
        "|" + "---|" * len(fields),
    ]
    lines += [
        "| " + " | ".join("" if r.get(f) is None else str(r.get(f)) for f in fields) + " |" for r in rows
    ]
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trial"]:
        _trial(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["table", "overhead"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes: check the code paths")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["naive", "1:never", "1:always", "2:never", "2:always"],
        help="naive and/or K:checkpoint (default: naive 1:never 1:always 2:never 2:always)",
    )
    parser.add_argument("--budget-mib", type=int, default=1024, help="memory per rank (default: 1024)")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches M (default: 8)")
    parser.add_argument("--max-layers", type=int, default=96)
    parser.add_argument("--layers", type=int, default=8, help="overhead: Transformer blocks (default: 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per trial")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/results/capacity"))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                "capacity.py --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
            )
    (table if args.command == "table" else overhead)(args)


if __name__ == "__main__":
    main()
