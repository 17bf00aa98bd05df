"""benchmarks/benchmark.py in a tiny configuration: CSV schema, timeline bubble, every run kind, capacity."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from benchmarks import worker
from benchmarks.benchmark import (
    COLUMNS,
    _part_memory,
    add_ratios,
    benchmark,
    capacity,
    format_memory,
    format_paired,
    format_table,
    median_interval,
    pool_turns,
    predict_window,
    report,
    run_env,
)
from benchmarks.worker import Alternation, _timeline_summary, pin_rank
from benchmarks.workloads import build_model
from lightning_gpipe.schedule import ideal_bubble
from lightning_gpipe.tools.simulate import simulate
from tests._harness import ROOT, _env
from tests.unit.tools.test_timeline import records_from_simulation

TINY = ["model.width=1024", "model.num_layers=4", "batch_size=512", "warmup=2", "timed=3", "threads=1"]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "benchmarks" / "conf"), version_base="1.3"):
        return compose(config_name="benchmark", overrides=overrides)


@pytest.mark.slow  # about 40 s: two M values; the every-run-kind test covers the driver in the default suite
@pytest.mark.timeout(150)
def test_sweep_writes_csv_rows_and_bubble_falls_from_m1_to_m8(tmp_path):
    """Hydra multirun over chunks=1,8 (ours only): one CSV row each, bubble in (0, 1), lower at M=8."""
    out = tmp_path / "k2.csv"
    command = [
        sys.executable,
        "benchmarks/benchmark.py",
        "-m",
        "chunks=1,8",
        "runs=[ours]",
        "predict=false",
        "memory=false",
        f"csv={out}",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        *TINY,
    ]
    proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [(r["run"], r["chunks"]) for r in rows] == [("ours", "1"), ("ours", "8")]
    bubble = {int(r["chunks"]): float(r["bubble"]) for r in rows}
    assert all(0.0 < b < 1.0 for b in bubble.values()), bubble
    assert bubble[8] < bubble[1], bubble
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
    assert (tmp_path / "timelines" / "ours_mlp_n512_k2_m8_never.png").exists()
    assert "normalized to the same run at M=1" in report(out)


@pytest.mark.timeout(120)
def test_ours_and_the_peer_report_throughput_memory_bubble_and_their_ratio(tmp_path):
    """ours and peer at M=4 with recompute (the default suite's driver check): the ratio, bubble,
    memory meter and cost model filled in; huge_pages=true: each stage's 4 MiB weights lie on
    transparent huge pages where the kernel offers them."""
    cfg = _compose(
        [
            *TINY,
            "chunks=4",
            "checkpoint=always",
            "huge_pages=true",
            "runs=[ours,peer]",
            f"csv={tmp_path / 'b.csv'}",
            "timeout=100",
        ]
    )
    rows = {r["run"]: r for r in benchmark(cfg)}
    assert set(rows) == {"ours", "peer"}
    ours = rows["ours"]
    assert ours["vs_peer"] == pytest.approx(ours["samples_per_s"] / rows["peer"]["samples_per_s"])
    for key in ("predicted_window_s", "predicted_bubble"):
        assert isinstance(ours[key], float), key
    assert 0.0 < ours["bubble"] < 1.0 and ours["bubble_ideal"] == pytest.approx(1 / 5)
    for run in ("ours", "peer"):
        assert rows[run]["activation_bytes"] > 0 and rows[run]["rss_bytes"] > 0
    assert len(ours["activation_bytes_stages"].split("|")) == 2
    with (tmp_path / "b.csv").open() as f:
        assert [r["run"] for r in csv.DictReader(f)] == ["ours", "peer"]
    for run in ("ours", "peer"):
        huge = [int(b) for b in rows[run]["huge_page_bytes_stages"].split("|")]
        assert rows[run]["huge_pages"] is True and len(huge) == 2
        if _transparent_huge_pages() in ("always", "madvise"):
            assert all(b >= 2 << 20 for b in huge), (run, huge)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "schedule, v",
    [
        pytest.param("gpipe", 1, marks=pytest.mark.slow),  # about 25 s each
        pytest.param("1f1b", 1, marks=pytest.mark.slow),
        ("interleaved_1f1b", 2),
    ],
)
def test_each_stages_peak_is_within_15_percent_of_the_memory_model(tmp_path, schedule, v):
    """ours, K = 2, M = 4, checkpoint "never", one step under the tensor-memory meter: each stage's
    peak is within 15 % of ``peak_activation_memory`` fed by the run's own profile, less the
    parameter gradients the per-micro-batch steps make afresh (BENCHMARKS.md section 6). The meter
    counts the received messages and the receives posted ahead, which the model must count too."""
    cfg = _compose(
        [
            *TINY,
            "chunks=4",
            "checkpoint=never",
            "memory=true",
            "runs=[ours]",
            f"schedule={schedule}",
            f"virtual_stages={v}",
            f"csv={tmp_path / 'm.csv'}",
            "timeout=100",
        ]
    )
    (row,) = benchmark(cfg)
    params = sum(p.numel() * p.element_size() for p in build_model(cfg.model).parameters())
    fresh = params / 2 if schedule != "gpipe" else 0  # two equal stages
    measured = [float(b) - fresh for b in row["activation_bytes_stages"].split("|")]
    model = [float(b) for b in row["predicted_activation_bytes_stages"].split("|")]
    assert len(measured) == len(model) == 2
    for stage, (a, b) in enumerate(zip(measured, model)):
        assert 0.85 <= a / b <= 1.15, (stage, a / 2**20, b / 2**20)


def test_alternation_times_each_turn_but_its_first_step_and_pairs_neighbouring_turns(monkeypatch):
    """Ours' steps take 1 s, the peer's 2 s, but the first step of every turn takes 10 s: with
    block 3 and 3 warm-up steps, the first turn is warm-up, each turn keeps its last two steps,
    and every block ratio is 2.0."""
    clock = [0.0]
    monkeypatch.setattr(worker.time, "perf_counter", lambda: clock[0])

    class Peer:
        def __init__(self) -> None:
            self.steps = 0

        def step(self, x, y) -> None:
            clock[0] += 10.0 if self.steps % 3 == 0 else 2.0
            self.steps += 1

    turns = Alternation({"warmup": 3, "timed": 6, "memory": False, "block": 3})
    turns.peer = Peer()
    for step in range(10):  # 9 steps, and one of a turn the peer never answers
        clock[0] += 10.0 if step % 3 == 0 else 1.0
        turns.after_ours(None, None)
    result = turns.result()
    assert result["step_s"] == [1.0] * 4 and result["peer_step_s"] == [2.0] * 4
    assert result["block_ratios"] == [2.0, 2.0]
    assert result["turn_windows"] == {  # the timed steps' spans of perf_counter, for benchmarks.perf_turns
        "ours": [[36.0, 37.0], [37.0, 38.0], [62.0, 63.0], [63.0, 64.0]],
        "peer": [[48.0, 50.0], [50.0, 52.0], [74.0, 76.0], [76.0, 78.0]],
    }
    with pytest.raises(ValueError, match="block=1"):
        Alternation({"warmup": 1, "timed": 1, "memory": False, "block": 1})
    assert Alternation.of({"memory": True}) is None
    with pytest.raises(ValueError, match="memory=false"):
        Alternation.of({"alternate": True, "memory": True})


@pytest.mark.slow  # 16 s; the fake-clock test covers the turns' bookkeeping in the default suite
@pytest.mark.timeout(120)
def test_alternate_runs_ours_and_the_peer_in_turns_and_reports_their_ratio(tmp_path, capsys):
    """alternate=true, 1F1B: ours takes turns with the peer in its own processes; the row holds the
    median of the per-block ratios, one per timed turn."""
    cfg = _compose(
        [
            *TINY,
            "schedule=1f1b",
            "runs=[ours]",
            "predict=false",
            "memory=false",
            "timed=6",
            "alternate=true",
            "block=2",
            f"csv={tmp_path / 'a.csv'}",
        ]
    )
    (row,) = benchmark(cfg)
    blocks = [float(b) for b in row["vs_peer_alternating_blocks"].split("|")]
    assert len(blocks) == 3 and all(b > 0 for b in blocks)  # warm-up turn 1; turns 2-4 timed
    assert row["vs_peer_alternating"] == pytest.approx(sorted(blocks)[1], abs=1e-3)  # blocks: 3 decimals
    assert "ours / peer, mlp 1f1b M=8, alternating" in capsys.readouterr().out


def _transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``None``."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def test_huge_pages_set_the_allocators_variable_for_every_run_whatever_the_shell_says(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    spec = {"threads": 1, "huge_pages": False}
    assert run_env(spec)["THP_MEM_ALLOC_ENABLE"] == "0"
    assert run_env({**spec, "huge_pages": True})["THP_MEM_ALLOC_ENABLE"] == "1"
    assert run_env({**spec, "huge_pages": True})["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("key", ["huge_pages", "pin", "alternate", "memory"])
def test_a_switch_that_is_not_true_or_false_is_refused_before_any_run(tmp_path, key):
    cfg = _compose([*TINY, f"{key}=yes", "runs=[ours]", f"csv={tmp_path / 'b.csv'}"])
    with pytest.raises(ValueError, match=f"{key} must be true or false \\({key}: 'yes'\\)"):
        benchmark(cfg)
    assert not (tmp_path / "b.csv").exists()


def test_repeats_of_an_alternating_run_pool_their_turns_per_stage():
    """Three sets of processes: each stage's block ratios are those of all three, in order, whatever
    order the ranks' results came in; each repeat's median is kept; the rest is the kept repeat's."""

    def rank(stage, blocks, cpu, step):
        return {"stage": stage, "block_ratios": blocks, "cpu_block_ratios": cpu, "step_s": [step]}

    repeats = [
        [rank(1, [0.9, 1.0, 1.1], [1.0], 0.3), rank(0, [2.0], [2.0], 0.3)],
        [rank(0, [3.0], [3.0], 0.2), rank(1, [0.95, 0.97, 0.99], [1.1], 0.2)],
        [rank(1, [1.2, 1.3, 1.4], [1.2], 0.4), rank(0, [4.0], [4.0], 0.4)],
    ]
    pooled = {r["stage"]: r for r in pool_turns(repeats[1], repeats)}
    assert pooled[1]["block_ratios"] == [0.9, 1.0, 1.1, 0.95, 0.97, 0.99, 1.2, 1.3, 1.4]
    assert pooled[1]["cpu_block_ratios"] == [1.0, 1.1, 1.2]
    assert pooled[1]["repeat_ratios"] == [1.0, 0.97, 1.3]
    assert pooled[0]["block_ratios"] == [2.0, 3.0, 4.0] and pooled[0]["step_s"] == [0.2]
    assert repeats[1][1]["block_ratios"] == [0.95, 0.97, 0.99]  # the repeats' own results untouched
    short = [[rank(1, [], [], 0.1)], [rank(1, [1.5], [1.5], 0.1)]]  # a repeat that timed no block
    assert pool_turns(short[0], short)[0]["repeat_ratios"] == [1.5]
    row = {"run": "ours", "model": "mlp", "schedule": "zb_h1", "chunks": 8, "vs_peer_alternating": 1.0}
    row["vs_peer_alternating_blocks"] = "|".join(["1.000"] * 9)
    row["vs_peer_alternating_repeats"] = "1.000|0.970|1.300"
    assert "median over 9 blocks of 3 sets of processes (each one's median: 1.000, 0.970, 1.300)" in (
        format_paired([row])
    )


def test_median_interval_is_the_sign_test_interval():
    """The 95 % interval of a median from n values: the j-th smallest and largest for the largest j
    with P(Bin(n, 1/2) < j) <= 2.5 % (tables: n = 6 → j = 1, n = 10 → 2, n = 20 → 6, n = 40 → 14)."""
    for n, j in [(6, 1), (10, 2), (20, 6), (40, 14)]:
        values = [float(v) for v in reversed(range(1, n + 1))]  # order does not matter
        assert median_interval(values) == (float(j), float(n + 1 - j))
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # even min–max covers only 93.8 %
    assert median_interval([]) is None


def test_pin_gives_each_rank_its_own_cores_wrapping_when_short():
    assert [pin_rank(r, 1, [0, 1]) for r in range(3)] == [[0], [1], [0]]
    assert [pin_rank(r, 2, [4, 5, 6, 7]) for r in range(2)] == [[4, 5], [6, 7]]
    assert pin_rank(1, 2, [3]) == [3, 3]


@pytest.mark.slow  # 25 s; pin_rank's unit test covers the core lists in the default suite
@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two ranks apart needs two cores")
def test_pinned_runs_put_each_stage_on_its_own_core(tmp_path):
    """pin=true: ours' and the peer's ranks each run on one core of their own (their threads too),
    recorded per stage in the row; the plain model is not pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    cfg = _compose([*TINY, "pin=true", "runs=[ours,peer]", f"csv={tmp_path / 'b.csv'}", "timeout=100"])
    rows = {r["run"]: r for r in benchmark(cfg)}
    for run in ("ours", "peer"):
        assert rows[run]["pin"] is True
        assert sorted(rows[run]["cpus_stages"].split("|")) == [str(cpus[0]), str(cpus[1])], rows[run]


@pytest.mark.slow  # about 55 s (six launches); the ours/peer test covers the driver in the default suite
@pytest.mark.timeout(150)
def test_every_run_kind_reports_throughput_memory_and_ratios(tmp_path):
    """ours, bare, peer and single at M=4 with recompute: ratios, memory meter and cost model filled in."""
    cfg = _compose([*TINY, "chunks=4", "checkpoint=always", f"csv={tmp_path / 'b.csv'}", "timeout=120"])
    rows = {r["run"]: r for r in benchmark(cfg)}
    assert set(rows) == {"ours", "bare", "peer", "single", "single_mt", "single_mb"}
    ours = rows["ours"]
    for key in (
        "vs_ideal",
        "vs_ideal_mb",
        "vs_peer",
        "lightning_overhead",
        "predicted_window_s",
        "predicted_bubble",
    ):
        assert isinstance(ours[key], float), key
    assert 0.0 < ours["bubble"] < 1.0 and 0.0 < rows["bare"]["bubble"] < 1.0
    assert ours["bubble_ideal"] == pytest.approx(1 / 5)
    for run in ("ours", "bare", "peer", "single"):
        assert rows[run]["activation_bytes"] > 0 and rows[run]["rss_bytes"] > 0
    # Recompute: a stage holds far less than the plain model's whole activations.
    assert ours["activation_bytes"] < rows["single"]["activation_bytes"]
    assert len(ours["activation_bytes_stages"].split("|")) == 2
    with (tmp_path / "b.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6
    # The ideal on the same micro-batches is K·M/(M+K-1) × single_mb's samples/s.
    ideal_mb = 2 * 4 / 5 * rows["single_mb"]["samples_per_s"]
    assert ours["vs_ideal_mb"] == pytest.approx(ours["samples_per_s"] / ideal_mb)


@pytest.mark.timeout(60)
def test_capacity_grows_with_recompute(tmp_path):
    """Bisection on num_layers under a 24 MiB budget: recompute ("always") fits more layers than "never"."""
    cfg = _compose(
        [
            "mode=capacity",
            f"csv={tmp_path / 'b.csv'}",
            "model.width=256",
            "batch_size=512",
            "chunks=8",
            "capacity.budget_bytes=25165824",
            "capacity.max_layers=64",
        ]
    )
    rows = {r["checkpoint"]: r for r in capacity(cfg)}
    assert 1 <= rows["never"]["num_layers"] < rows["always"]["num_layers"] <= 64
    assert all(r["need_bytes"] <= 25165824 for r in rows.values())
    with (tmp_path / "capacity.csv").open() as f:
        assert [r["checkpoint"] for r in csv.DictReader(f)] == ["never", "always"]


@pytest.mark.timeout(120)
def test_bare_runs_1f1b_per_micro_batch_and_skips_interleaved(tmp_path, capsys):
    """schedule=1f1b runs bare with one stage call per micro-batch (its row names the schedule and
    its timeline has every micro-batch's forward and backward); interleaved_1f1b skips bare with a
    message."""
    cfg = _compose([*TINY, "schedule=1f1b", "runs=[bare]", "predict=false", f"csv={tmp_path / 'a.csv'}"])
    (row,) = benchmark(cfg)
    assert row["run"] == "bare" and row["schedule"] == "1f1b" and row["samples_per_s"] > 0
    assert 0.0 < row["bubble"] < 1.0
    assert 0.0 < row["latency_gloo_s"] < 1.0 and 0.0 < row["latency_s"] < 1.0
    assert "torch.distributed isend/irecv" in capsys.readouterr().out
    cfg = _compose(
        [*TINY, "schedule=interleaved_1f1b", "runs=[bare]", "predict=false", f"csv={tmp_path / 'b.csv'}"]
    )
    assert benchmark(cfg) == []
    assert "skipping bare" in capsys.readouterr().out


def test_predict_window_plays_the_rows_own_schedule():
    """predict_window plays the row's schedule (here interleaved, v = 2)."""
    row = {
        "forward_s_stages": "1|1",
        "backward_s_stages": "2|2",
        "stages": 2,
        "chunks": 4,
        "checkpoint": "never",
        "batch_size": 8,
        "schedule": "interleaved_1f1b",
        "virtual_stages": 2,
    }
    expected = simulate(2, 4, 1.0, 2.0, schedule="interleaved_1f1b", virtual_stages=2, checkpoint="never")
    assert predict_window(row) == pytest.approx(expected.step_time)
    assert predict_window(row) < predict_window({**row, "schedule": "gpipe", "virtual_stages": 1})


def test_interleaved_rows_take_the_bubble_limited_ideal_and_show_each_stages_bubble():
    """Under interleaved_1f1b v=2 the ideal is K·M/(M+(K-1)/v) × one stage's samples/s, for ours and
    the peer alike; ours/peer is their ratio; the table names the schedule and each stage's bubble."""
    base = {"stages": 2, "chunks": 8, "batch_size": 64, "checkpoint": "never"}
    ours = {**base, "run": "ours", "samples_per_s": 300.0, "samples_per_s_best": 320.0}
    ours.update(schedule="interleaved_1f1b", virtual_stages=2, bubble=0.1, bubble_ideal=ideal_bubble(2, 8, 2))
    ours["bubble_stages"] = "0.08|0.12"
    peer = {**ours, "run": "peer", "samples_per_s": 250.0, "bubble": None, "bubble_stages": None}
    single = {**base, "run": "single", "stages": 1, "samples_per_s": 200.0, "samples_per_s_best": 200.0}
    rows = [ours, peer, single]
    add_ratios(rows)
    ideal = 2 * 8 / (8 + 1 / 2) * 200.0
    assert ours["ideal_samples_per_s"] == pytest.approx(ideal) == peer["ideal_samples_per_s"]
    assert ours["vs_ideal"] == pytest.approx(300.0 / ideal)
    assert ours["vs_peer"] == pytest.approx(300.0 / 250.0)
    table = format_table([{c: r.get(c) for c in COLUMNS} for r in rows])
    assert "| ours | interleaved_1f1b v=2 | 2 | 8 |" in table
    assert "| 0.10 (0.06) | 0.08 / 0.12 |" in table


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_workers_timeline_summary_gives_each_stages_bubble(schedule, v):
    """benchmarks.worker's summary of gathered records: the bubble and each stage's idle share per
    timed step."""
    records, sim = records_from_simulation(2, 4, schedule=schedule, virtual_stages=v, steps=3)
    summary = _timeline_summary(records, {"warmup": 1, "timed": 2})
    assert summary["bubble"] == [pytest.approx(sim.bubble)] * 2
    assert summary["stage_bubble"] == [pytest.approx([1 - b / sim.step_time for b in sim.busy])] * 2


# about 60 s: four small jobs; the every-run-kind test covers the driver in the default suite
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_schedules_run_ours_against_the_peers_same_schedule(tmp_path, schedule, v):
    """schedule=1f1b and interleaved_1f1b (v=2): ours and the peer (Schedule1F1B /
    ScheduleInterleaved1F1B) run, ours/peer and the measured bubble per stage are filled in."""
    overrides = [*TINY, "chunks=4", f"schedule={schedule}", f"virtual_stages={v}", "memory=false"]
    cfg = _compose(
        [*overrides, "runs=[ours,peer]", "predict=false", f"csv={tmp_path / 'b.csv'}", "timeout=200"]
    )
    rows = {r["run"]: r for r in benchmark(cfg)}
    assert set(rows) == {"ours", "peer"}
    assert all((r["schedule"], r["virtual_stages"]) == (schedule, v) for r in rows.values())
    assert isinstance(rows["ours"]["vs_peer"], float) and rows["peer"]["samples_per_s"] > 0
    assert rows["ours"]["bubble_ideal"] == pytest.approx(ideal_bubble(2, 4, v))
    stages = [float(b) for b in rows["ours"]["bubble_stages"].split("|")]
    assert len(stages) == 2 and all(0.0 <= b < 1.0 for b in stages)


def test_part_memory_is_what_the_forward_leaves_alive_and_the_backward_peak_above_it():
    """Two Linear(8, 8) parts, 2 samples (float32), .grad existing. Each forward leaves its output
    alive (2·8·4 = 64 bytes; its input was allocated before). The backward of part 0 needs the
    received gradient (64), the weight's gradient before it is added into .grad (8·8·4 = 256)
    and the bias's (32): 352; part 1, the last, gets its gradient from the loss (not counted
    here: the loss's side) and sends its input's back (64): 352."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert _part_memory(model, [1, 1], torch.randn(2, 8)) == ([64.0, 64.0], [352.0, 352.0])
    assert all(p.grad is None for p in model.parameters())


def test_memory_lines_put_the_model_next_to_each_stage_less_fresh_gradients():
    mib = 2**20
    rows = [
        {
            "run": "ours",
            "schedule": "1f1b",
            "virtual_stages": 1,
            "chunks": 4,
            "activation_bytes_stages": f"{28 * mib}|{26 * mib}",
            "predicted_activation_bytes_stages": f"{13 * mib}|{10 * mib}",
        },
        {
            "run": "ours",
            "schedule": "gpipe",
            "virtual_stages": 1,
            "chunks": 4,
            "activation_bytes_stages": f"{21 * mib}|{25 * mib}",
            "predicted_activation_bytes_stages": f"{21 * mib}|{20 * mib}",
        },
    ]
    lines = format_memory(rows, [16 * mib, 16 * mib]).splitlines()
    assert lines[0] == (
        "ours 1f1b M=4: peak MiB per stage: 12.0 [meter 28.0] (model 13.0, ratio 0.92)"
        " | 10.0 [meter 26.0] (model 10.0, ratio 1.00)"
    )
    assert lines[1].endswith(
        "21.0 [meter 21.0] (model 21.0, ratio 1.00) | 25.0 [meter 25.0] (model 20.0, ratio 1.25)"
    )
