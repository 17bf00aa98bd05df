import json
from pathlib import Path

import pytest
import torch

from tests._harness import check, run_script


@pytest.fixture
def gpipe_job(tmp_path):
    """Run tests/workers/train.py on a spec; returns (rank-0 results per run, grads per run per rank)."""

    def run(kind: str, devices: int, runs: list[dict], timeout: float = 240, **spec):
        spec = dict(spec, kind=kind, devices=devices, runs=runs, out=str(tmp_path))
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        check(run_script("tests/workers/train.py", str(path), timeout=timeout))
        results = [torch.load(tmp_path / f"run{k}.pt") for k in range(len(runs))]
        grads = [
            [torch.load(tmp_path / f"run{k}_rank{r}.pt")["grads"] for r in range(devices)]
            for k in range(len(runs))
        ]
        return results, grads

    return run


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


@pytest.fixture
def tmp_out(tmp_path) -> Path:
    return tmp_path
