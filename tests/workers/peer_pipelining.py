"""Worker: one training step of tests.models.Net("mlp") under torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble.

Usage (one process per stage, RANK/WORLD_SIZE set):
python tests/workers/peer_pipelining.py OUT CHUNKS BATCH [SCHEDULE ...]
SCHEDULE: ``gpipe`` (ScheduleGPipe, the default), ``1f1b`` (Schedule1F1B) or ``interleaved_1f1b``
(ScheduleInterleaved1F1B with two virtual stages: rank p holds the peer's stages p and p+K of K·2)
or ``zb_h1`` (ScheduleInterleavedZeroBubble with one stage per rank: ZB-H1);
each runs one step from the same weights.
Rank r runs stage r (and r+K) on the same layer split as GPipeStrategy's uniform balance and writes
``peer_rank{r}.pt`` (``peer_{schedule}_rank{r}.pt`` for the others) with its gradients under the
user's parameter names.
"""

import sys
from collections import OrderedDict
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from lightning_gpipe.partition.cut import uniform_balance, virtual_cut
from tests.models import Net, make_data

torch.set_num_threads(1)
out, chunks, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4:] or ["gpipe"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pl.seed_everything(0, verbose=False)
model = Net("mlp")
x, y = next(iter(make_data("mlp", batch=batch, steps=5)))  # the data tests/workers/train.py uses


def loss_fn_exact(output, target):
    return F.mse_loss(output, target, reduction="sum") / (batch * target.shape[1])


for name in names:
    v = 2 if name == "interleaved_1f1b" else 1
    parts = virtual_cut(model.layers, uniform_balance(len(model.layers), world * v), rank, world)
    submodules = [nn.Sequential(OrderedDict(layers)) for layers in parts]  # peer stages rank, rank + K, ...
    model.zero_grad(set_to_none=True)
    stages = [
        PipelineStage(sub, rank + u * world, world * v, torch.device("cpu"))
        for u, sub in enumerate(submodules)
    ]
    if name in ("interleaved_1f1b", "zb_h1"):
        multi = ScheduleInterleaved1F1B if name == "interleaved_1f1b" else ScheduleInterleavedZeroBubble
        schedule = multi(stages, n_microbatches=chunks, loss_fn=loss_fn_exact, scale_grads=False)
    else:
        peer_schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        schedule = peer_schedule(stages[0], n_microbatches=chunks, loss_fn=loss_fn_exact, scale_grads=False)
    if rank == 0:  # holds the first stage (and, interleaved, not the last: that is stage 2K-1 on rank K-1)
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    grads = {f"layers.{n}": p.grad.detach().clone() for sub in submodules for n, p in sub.named_parameters()}
    torch.save(
        grads,
        out / ("peer_rank{rank}.pt" if name == "gpipe" else f"peer_{name}_rank{{rank}}.pt").format(rank=rank),
    )
    dist.barrier()
dist.destroy_process_group()
