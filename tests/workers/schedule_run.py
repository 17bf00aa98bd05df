"""Worker: one training step of bare pipeline stages per schedule and M, recording the actions each stage ran.

Usage: python tests/workers/schedule_run.py OUT M [M ...] (torchrun-style env: RANK, WORLD_SIZE)
Every rank runs its stage of a small MLP (K = WORLD_SIZE stages) through one training step for
each M under fill-drain (one call per step, as under ``schedule="gpipe"``), under 1F1B and under
ZB-H1 with ``checkpoint="never"`` (one call per micro-batch, each micro-batch's loss backpropagated
right after its call, as under ``schedule="1f1b"``: :func:`tests.fakes.micro_step`), with a recorder
in place of the timeline, and writes ``OUT/rank<r>.json``: for each ``"<schedule>:<M>"``, the stage
index and the ``F``/``B``/``W`` actions the stage executed, in order (``W i``: a weight-gradient pass,
:mod:`lightning_gpipe.engine.backward_split`).
"""

import itertools
import json
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.schedule import one_f_one_b, zb_h1
from lightning_gpipe.transport.layout import Layout
from tests.fakes import micro_step


class Recorder:
    """Stands in for the timeline: keeps the forward and backward spans, in order."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    @contextmanager
    def span(self, kind: str, i: int, u: int = 0):
        if kind in ("forward", "backward", "weights"):  # as str(Action)
            self.actions.append(f"{kind[0].upper()}{i}" + (f"v{u}" if u else ""))
        yield


out, chunks = Path(sys.argv[1]), [int(m) for m in sys.argv[2:]]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
seq = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
x, y = torch.randn(8, 4), torch.randn(8, 4)
recorded = {}
for m in chunks:
    stage = build_stage(
        seq, uniform_balance(3, world), Layout(world, world), rank, m, "except_last", torch.device("cpu")
    )
    stage.timeline = recorder = Recorder()
    out_ = stage.run_step(stage, True, x)
    loss = nn.functional.mse_loss(out_, y) if stage.topology.is_last else None
    shared = stage.share_outcome(loss, None, training=True)
    if loss is not None:
        loss.backward()
    assert shared is not None
    stage.backward()
    recorded[f"gpipe:{m}"] = {"stage": stage.topology.stage, "actions": recorder.actions}
for (name, schedule, checkpoint), m in itertools.product(
    [("1f1b", one_f_one_b, "except_last"), ("zb_h1", zb_h1, "never")], chunks
):
    stage = build_stage(
        seq, uniform_balance(3, world), Layout(world, world), rank, m, checkpoint, torch.device("cpu"),
        schedule=schedule,
    )  # fmt: skip
    stage.timeline = recorder = Recorder()
    micro_step(stage, (x, y), lambda b, stage=stage: nn.functional.mse_loss(stage(b[0]), b[1]))
    recorded[f"{name}:{m}"] = {"stage": stage.topology.stage, "actions": recorder.actions}
(out / f"rank{rank}.json").write_text(json.dumps(recorded))
dist.barrier()
dist.destroy_process_group()
