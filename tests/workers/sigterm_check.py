"""Worker: :class:`lightning_gpipe.strategy.signals.SigtermCheck` on two Gloo ranks (torchrun-style env).

Usage: python tests/workers/sigterm_check.py OUT
Each rank calls the check once per 100 ms "step" (as the training epoch loop would) until it
raises, rank 1 50 ms after rank 0.
Only rank 1 records a signal (SIGTERM), after call 2: a signal to any one rank stops every rank
(Lightning's own check counts rank 0's only). Each rank writes to OUT/rank{r}.json the call that
raised, the exit code it raised with and the seconds the calls before it waited in all.
"""

import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_gpipe.strategy.signals import SigtermCheck


class Stop(SystemExit):
    pass


out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
recorded = [0]
check = SigtermCheck(torch.device("cpu"), Stop, flag=lambda: recorded[0])
raised, code, waited = None, None, 0.0
if rank == 1:
    time.sleep(0.05)  # rank 1 comes 50 ms after rank 0 to every call: rank 0 must not wait for it
for call in range(8):
    time.sleep(0.1)  # the step
    start = time.perf_counter()
    try:
        check()
    except Stop as stop:
        raised, code = call, stop.code
        break
    finally:
        waited += time.perf_counter() - start if rank == 0 else 0.0
    if (rank, call) == (1, 2):
        recorded[0] = int(signal.SIGTERM)
check.close(10)
result = {"raised": raised, "code": code, "stopped_by": check.stopped_by, "rank0_waited_s": waited}
(out / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
