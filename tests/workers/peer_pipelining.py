"""Worker: one training step of tests.models.Net("mlp") under torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B.

Usage (one process per stage, RANK/WORLD_SIZE set): python tests/workers/peer_pipelining.py OUT CHUNKS BATCH [SCHEDULE ...]
SCHEDULE: ``gpipe`` (ScheduleGPipe, the default) or ``1f1b`` (Schedule1F1B); each runs one step from
the same weights.
Rank r runs stage r on the same layer split as GPipeStrategy's uniform balance and writes
``peer_rank{r}.pt`` with its gradients under the user's parameter names.
"""

import sys
from collections import OrderedDict
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lightning_gpipe.partition import cut, uniform_balance
from tests.models import Net, make_data

torch.set_num_threads(1)
out, chunks, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4:] or ["gpipe"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pl.seed_everything(0, verbose=False)
model = Net("mlp")
layers = cut(model.layers, uniform_balance(len(model.layers), world), rank)
submodule = nn.Sequential(OrderedDict(layers))
x, y = next(iter(make_data("mlp", batch=batch, steps=5)))  # the data tests/workers/train.py uses


def loss_fn_exact(output, target):
    return F.mse_loss(output, target, reduction="sum") / (batch * target.shape[1])


for name in names:
    submodule.zero_grad(set_to_none=True)
    stage = PipelineStage(submodule, rank, world, torch.device("cpu"))
    peer_schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    schedule = peer_schedule(stage, n_microbatches=chunks, loss_fn=loss_fn_exact, scale_grads=False)
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    grads = {f"layers.{n}": p.grad.detach().clone() for n, p in submodule.named_parameters()}
    torch.save(
        grads,
        out / ("peer_rank{rank}.pt" if name == "gpipe" else f"peer_{name}_rank{{rank}}.pt").format(rank=rank),
    )
    dist.barrier()
dist.destroy_process_group()
