"""Worker: two ranks, one with an inf gradient; PipelineGradScaler must make both skip and agree on the scale.

Usage (RANK/WORLD_SIZE set, 2 processes): python tests/workers/scaler.py OUT
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_gpipe.strategy.precision import PipelineGradScaler

dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1])
param = torch.nn.Parameter(torch.ones(3))
optimizer = torch.optim.SGD([param], lr=0.1)
scaler = PipelineGradScaler.from_scaler(torch.amp.GradScaler("cpu", init_scale=1024.0))
records = []
for step in range(3):
    optimizer.zero_grad()
    scaler.scale((param * 2.0).sum()).backward()
    if rank == 0 and step == 1:
        param.grad[0] = float("inf")  # only rank 0 overflows, only in step 1
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    records.append({"param": param.detach().clone(), "scale": scaler.get_scale()})
torch.save(records, out / f"scaler_rank{rank}.pt")
dist.destroy_process_group()
