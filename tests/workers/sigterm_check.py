"""Worker: :class:`lightning_gpipe.strategy.signals.SigtermCheck` on two Gloo ranks (torchrun-style env).

Usage: python tests/workers/sigterm_check.py OUT
Each rank calls the check once per 100 ms "step" (as the training epoch loop would) until it
raises, rank 1 50 ms after rank 0.
Rank 0 sets its ``received_sigterm`` after call 2; rank 1 sets its own after call 0 (which
Lightning's check ignores: only rank 0's flag counts). Each rank writes to OUT/rank{r}.json the
call that raised and the seconds the calls before it waited in all.
"""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from lightning_gpipe.strategy.signals import SigtermCheck


class Stop(SystemExit):
    pass


out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
trainer = SimpleNamespace(received_sigterm=False)
check = SigtermCheck(trainer, torch.device("cpu"), Stop)
raised, waited = None, 0.0
if rank == 1:
    time.sleep(0.05)  # rank 1 comes 50 ms after rank 0 to every call: rank 0 must not wait for it
for call in range(8):
    time.sleep(0.1)  # the step
    start = time.perf_counter()
    try:
        check()
    except Stop:
        raised = call
        break
    finally:
        waited += time.perf_counter() - start if rank == 0 else 0.0
    if (rank, call) in ((0, 2), (1, 0)):
        trainer.received_sigterm = True
check.close(10)
(out / f"rank{rank}.json").write_text(json.dumps({"raised": raised, "rank0_waited_s": waited}))
dist.destroy_process_group()
