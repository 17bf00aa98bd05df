import json

import pytest
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.device_mesh import DeviceMesh

from tests._harness import check, run_ranks


@pytest.fixture
def gpipe_job(tmp_path):
    """Run tests/workers/train.py on a spec, its ``devices`` ranks started together, torchrun-style.

    Started by Lightning's launcher instead, the other ranks would begin importing torch and
    Lightning (some 5 s each on 2 cores) only once rank 0 has reached ``fit``. The launcher's own
    path is run by the tests that call :func:`tests._harness.run_script` (the recipes, failures and
    signals).

    Returns ``(results, grads)``: per run, rank 0's record (with ``ranks``: every rank's record,
    ``output``: the job's stdout and stderr),
    and per run the gradients each rank recorded.
    """

    def run(kind: str, devices: int, runs: list[dict], timeout: float = 240, **spec):
        spec = dict(spec, kind=kind, devices=devices, runs=runs, out=str(tmp_path))
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        results = run_ranks("tests/workers/train.py", devices, str(path), timeout=timeout)
        output = "\n".join(check(r) for r in results)
        ranks = [
            [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(devices)]
            for k in range(len(runs))
        ]
        results = [dict(per_rank[0], ranks=per_rank, output=output) for per_rank in ranks]
        grads = [[record["grads"] for record in per_rank] for per_rank in ranks]
        return results, grads

    return run


@pytest.fixture
def mesh():
    """A one-rank ``"tensor_parallel"`` mesh on a Gloo process group of this process (DTensors in process)."""
    store = dist.TCPStore("127.0.0.1", find_free_network_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0], mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)
