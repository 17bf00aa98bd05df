"""benchmarks/mesh.py at --small: every row trains, and each rank holds the parameter and Adam bytes its
mesh implies, counted from the unpartitioned model."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from benchmarks.mesh import SIZES
from benchmarks.workloads import LlamaBlock, build_llama
from lightning_gpipe import GPipeStrategy
from tests._harness import ROOT, _env


def _fsdp_supported() -> bool:
    try:
        GPipeStrategy(pipeline_parallel_size=2, data_parallel_size=2, data_parallel="fsdp")
    except ValueError:
        return False
    return True


def _counts() -> tuple[int, int]:
    """Elements of the small model: (in the blocks' linear layers, everywhere else)."""
    size = SIZES["small"]
    model = build_llama(**{key: size[key] for key in ("vocab", "dim", "heads", "hidden", "depth")})
    linear = sum(
        p.numel()
        for block in model
        if isinstance(block, LlamaBlock)
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
        for p in m.parameters()
    )
    return linear, sum(p.numel() for p in model.parameters()) - linear


@pytest.mark.slow  # six jobs of fresh processes: minutes on 2 loaded cores
@pytest.mark.timeout(900)
def test_every_row_trains_and_holds_its_share_of_the_model(tmp_path):
    command = [sys.executable, "-m", "benchmarks.mesh", "--small", "--timeout", "240", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (tmp_path / "mesh.csv").open() as handle:
        rows = {r["row"]: r for r in csv.DictReader(handle)}
    raw = json.loads((tmp_path / "mesh.json").read_text())
    fsdp = _fsdp_supported()
    assert set(rows) == {"single", "pp2_dp2", "pp2_fsdp2", "pp2_tp2", "mps_fsdp4", "mps_tp4"}
    for name, row in rows.items():
        if name == "pp2_fsdp2" and not fsdp:
            assert "data_parallel='fsdp'" in row["error"], row
            continue
        assert row["error"] == "", row
        assert float(row["samples_per_s"]) > 0 and int(row["peak_mib_max"]) >= 0, row
        assert len(raw[name]) == (1 if name == "single" else 4)
    linear, other = _counts()
    whole = 4 * (linear + other)  # fp32 bytes

    def held(name: str) -> list[int]:
        return [r["param_bytes"] for r in raw[name]]

    assert held("single") == [whole] and raw["single"][0]["optimizer_bytes"] == 2 * whole
    assert held("mps_fsdp4") == [whole // 4] * 4  # the small sizes divide by 4: equal shards
    assert held("mps_tp4") == [4 * (linear // 4 + other)] * 4  # the blocks' linears split, the rest whole
    dp = held("pp2_dp2")  # ranks 0, 1: replica 0's last and first stage; 2, 3: replica 1's
    assert dp[0] + dp[1] == whole and dp[:2] == dp[2:] and 0 < dp[0] < whole
    assert sum(held("pp2_tp2")) == 4 * (linear + 2 * other)  # per stage: linears split over 2, rest on both
    if fsdp:
        assert sum(held("pp2_fsdp2")) == whole and max(held("pp2_fsdp2")) < 0.3 * whole
    for name in rows:
        if raw.get(name):
            for record in raw[name]:  # Adam: two moments of every parameter this rank holds
                assert record["optimizer_bytes"] == 2 * record["param_bytes"], (name, record)
