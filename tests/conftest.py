import json

import pytest
import torch

from tests._harness import check, run_script


@pytest.fixture
def gpipe_job(tmp_path):
    """Run tests/workers/train.py on a spec.

    Returns ``(results, grads)``: per run, rank 0's record (with ``ranks``: every rank's record,
    ``output``: the job's stdout and stderr),
    and per run the gradients each rank recorded.
    """

    def run(kind: str, devices: int, runs: list[dict], timeout: float = 240, **spec):
        spec = dict(spec, kind=kind, devices=devices, runs=runs, out=str(tmp_path))
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        output = check(run_script("tests/workers/train.py", str(path), timeout=timeout))
        ranks = [
            [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(devices)]
            for k in range(len(runs))
        ]
        results = [dict(per_rank[0], ranks=per_rank, output=output) for per_rank in ranks]
        grads = [[record["grads"] for record in per_rank] for per_rank in ranks]
        return results, grads

    return run


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)
