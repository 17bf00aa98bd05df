"""Worker: train tests.user_code cases under GPipeStrategy, every rank recording what its hooks saw.

Usage: python tests/workers/user_code.py SPEC.json (torchrun-style, one process per rank)
Spec: {"out": dir, "devices": n, "runs": [{"case": "outputs" | "tokens", "strategy": GPipeStrategy
kwargs, "trainer": extra Trainer kwargs}]}; each rank writes ``run{k}_rank{r}.pt``.
"""

import json
import sys
from pathlib import Path

import torch

import lightning_gpipe
from tests.user_code import train

torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(spec["out"])
for k, run in enumerate(spec["runs"]):
    strategy = lightning_gpipe.GPipeStrategy(**run.get("strategy", {}))
    record = train(run["case"], strategy, spec["devices"], run.get("trainer"))
    torch.save(record, out / f"run{k}_rank{record['rank']}.pt")
print("worker done")
