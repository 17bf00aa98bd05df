"""Benchmark: does balancing by profiled time shorten the slowest stage?

Builds an ``nn.Sequential`` of thin layers (one ``Linear(d, d)``) and a few wide ones (a
``Linear(d, h) -> ReLU -> Linear(h, d)`` block with ``h = expand·d/2``, about ``expand``
times the work of a thin layer), profiles it layer by layer (``profile_times``, the profiler
behind ``balance_by_time``), and for each stage count compares the largest stage's measured
forward+backward time under a uniform balance (equal layer counts) and under the time balance
(``balance_cost`` of the profiled costs, which is what ``balance_by_time`` returns). It also
checks that balance against a brute-force search over all balances of the same profiled costs,
and finally prints what ``balance_by_time`` itself returns (it profiles again).

Run: ``python -m benchmarks.balance_time [--layout WWWtttttt] [--stages 2 3]``
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch import nn

from lightning_gpipe.balance import balance_by_time, balance_cost, profile_times, uniform_balance
from lightning_gpipe.balance.blockpartition import stage_costs


def build_model(layout: str, width: int, expand: int) -> nn.Sequential:
    """One layer per character of ``layout``: ``W`` wide, ``t`` thin."""
    hidden = max(1, expand * width // 2)
    layers: list[nn.Module] = []
    for char in layout:
        if char == "W":
            layers.append(nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)))
        elif char == "t":
            layers.append(nn.Linear(width, width))
        else:
            raise SystemExit(f"layout may only hold 'W' and 't' (got {char!r})")
    return nn.Sequential(*layers)


def stages_of(model: nn.Sequential, balance: list[int]) -> list[nn.Sequential]:
    bounds = [0, *itertools.accumulate(balance)]
    layers = list(model)
    return [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(bounds)]


def run_stage(stage: nn.Sequential, x: torch.Tensor) -> float:
    """Seconds of one forward + backward of ``stage`` on ``x`` (gradients discarded)."""
    start = time.perf_counter()
    y = stage(x)
    wrt = [p for p in stage.parameters()] + ([x] if x.requires_grad else [])
    torch.autograd.grad([y], wrt, [torch.ones_like(y)])
    return time.perf_counter() - start


def measure_largest_stage(
    model: nn.Sequential, balances: dict[str, list[int]], sample: torch.Tensor, repeats: int, stat: str
) -> dict[str, float]:
    """Seconds of each stage (``stat``: min or median over ``repeats`` runs), interleaving
    the balances so that they share any drift in load; returns the largest stage per balance."""
    reduce = min if stat == "min" else statistics.median
    plans = {name: stages_of(model, balance) for name, balance in balances.items()}
    inputs: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():  # each stage's real input, as it would arrive from the previous stage
        for name, stages in plans.items():
            x, xs = sample, []
            for j, stage in enumerate(stages):
                xs.append(x.detach().requires_grad_(j > 0))
                x = stage(x)
            inputs[name] = xs
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats + 2):  # the first two rounds are warm-up
        for name, stages in plans.items():
            for j, stage in enumerate(stages):
                seconds = run_stage(stage, inputs[name][j])
                if r >= 2:
                    times.setdefault((name, j), []).append(seconds)
    return {name: max(reduce(times[(name, j)]) for j in range(len(stages))) for name, stages in plans.items()}


def brute_force_optimum(costs: list[float], partitions: int) -> tuple[float, list[int]]:
    """The smallest largest-stage cost over all balances, and the balance the documented
    tie-break picks among those (costs desc, sizes desc, larger stages first)."""
    candidates = []
    for cuts in itertools.combinations(range(1, len(costs)), partitions - 1):
        bounds = (0, *cuts, len(costs))
        balance = [b - a for a, b in itertools.pairwise(bounds)]
        key = (
            sorted(stage_costs(costs, balance), reverse=True),
            sorted(balance, reverse=True),
            [-n for n in balance],
        )
        candidates.append((key, balance))
    key, balance = min(candidates)
    return key[0][0], balance


def fmt(measured: float, predicted: list[float]) -> str:
    return f"{measured * 1e3:.2f} ({max(predicted) * 1e3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layout", default="WWWtttttt", help="W = wide layer, t = thin (default: %(default)s)"
    )
    parser.add_argument("--width", type=int, default=256, help="features d (default: %(default)s)")
    parser.add_argument("--expand", type=int, default=10, help="wide/thin work ratio (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="sample batch size (default: %(default)s)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="stage counts (default: 2 3)")
    parser.add_argument("--timeout", type=float, default=1.0, help="profiling seconds (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per stage (default: %(default)s)")
    parser.add_argument(
        "--stat",
        choices=["min", "median"],
        default="min",
        help="per-stage statistic over the runs; min is least disturbed by other processes "
        "(default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args.layout, args.width, args.expand)
    sample = torch.randn(args.batch, args.width)

    costs = profile_times(model, sample, timeout=args.timeout)
    print(f"layout {args.layout}, width {args.width}, expand {args.expand}, batch {args.batch}")
    print("profiled forward+backward per layer (ms): " + " ".join(f"{c * 1e3:.2f}" for c in costs))
    print()
    header = (
        f"{'stages':>6}  {'uniform balance':<18}{'time balance':<18}"
        f"{'uniform max ms':>16}{'time max ms':>16}{'ratio':>7}  {'optimal':<8}"
    )
    print(f"max ms: the largest stage's measured forward+backward {args.stat} (profiled sum in brackets)")
    print(header)
    print("-" * len(header))
    for k in args.stages:
        uniform = uniform_balance(len(model), k)
        timed = balance_cost(costs, k)  # what balance_by_time does after profiling
        measured = measure_largest_stage(
            model, {"uniform": uniform, "time": timed}, sample, args.repeats, args.stat
        )
        optimum, optimal_balance = brute_force_optimum(costs, k)
        chosen = max(stage_costs(costs, timed))
        ratio = measured["uniform"] / measured["time"]
        print(
            f"{k:>6}  {str(uniform):<18}{str(timed):<18}"
            f"{fmt(measured['uniform'], stage_costs(costs, uniform)):>16}"
            f"{fmt(measured['time'], stage_costs(costs, timed)):>16}{ratio:>7.2f}  "
            f"{'yes' if chosen == optimum else 'NO'} (max {chosen * 1e3:.2f} ms, brute force "
            f"{optimum * 1e3:.2f} ms, {'same' if timed == optimal_balance else 'other'} partition)"
        )
    print()
    print("balance_by_time (profiles again, so noise may move a cut):")
    for k in args.stages:
        print(f"  {k} stages: {balance_by_time(model, sample, k, timeout=args.timeout)}")


if __name__ == "__main__":
    main()
