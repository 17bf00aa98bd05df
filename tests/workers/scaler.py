"""Worker: two ranks, one with an inf gradient; PipelineGradScaler must make both skip and agree on the scale.

A second parameter is a ``DTensor`` sharded over both ranks (as ``data_parallel="fsdp"`` and a
tensor-parallel plan hold them): rank 0's inf lies in its own shard only, and both ranks skip it too.

Usage (RANK/WORLD_SIZE set, 2 processes): python tests/workers/scaler.py OUT
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_gpipe.strategy.precision import PipelineGradScaler

dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1])
mesh = init_device_mesh("cpu", (2,))
param = torch.nn.Parameter(torch.ones(3))
sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))  # 2 elements a rank
optimizer = torch.optim.SGD([param, sharded], lr=0.1)
scaler = PipelineGradScaler.from_scaler(torch.amp.GradScaler("cpu", init_scale=1024.0))
records = []
for step in range(5):
    optimizer.zero_grad()
    scaler.scale((param * 2.0).sum() + (sharded * 2.0).sum().full_tensor()).backward()
    if rank == 0 and step == 1:
        param.grad[0] = float("inf")  # only rank 0 overflows, only in step 1
    if rank == 0 and step == 3:
        sharded.grad.to_local()[0] = float("inf")  # only rank 0's shard overflows, only in step 3
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    whole = sharded.detach().full_tensor()
    records.append({"param": param.detach().clone(), "sharded": whole, "scale": scaler.get_scale()})
torch.save(records, out / f"scaler_rank{rank}.pt")
dist.destroy_process_group()
