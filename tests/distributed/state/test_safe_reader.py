"""No planted checkpoint runs code in a real fit: ``fit(ckpt_path=...)`` over 2 stages from a checkpoint
with a pickled payload in ``.metadata``, a non-tensor entry of a shard, ``lightning_meta.pt`` or a full
file ends every rank with ``UnsafeCheckpointError`` naming that file, and the payload runs on no rank
(issue 41, item 1; tests/unit/state/test_safe_reader.py checks the reader itself, in one process).
A later fit in the same processes trains as on one device (the failed fit's process group is gone, the
next one connects anew)."""

import json

import pytest
import torch

from tests._harness import check, run_ranks
from tests.conftest import max_diff
from tests.models import train_single_device
from tests.planted import PLANTS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.__name__)
def test_fit_from_a_planted_checkpoint_ends_every_rank_naming_the_file_and_runs_nothing(tmp_path, plant):
    marker = tmp_path / "marker"  # what the payload writes, on whichever rank unpickles it
    path, culprit = plant(tmp_path, marker)
    spec = dict(kind="mlp", devices=2, runs=[], out=str(tmp_path), planted={"kind": "mlp", "path": str(path)})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    results = run_ranks("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=120)
    for rank, result in enumerate(results):
        out = check(result)  # the later fit ended the job normally
        refused = json.loads((tmp_path / f"refused_rank{rank}.json").read_text())
        expected = f"UnsafeCheckpointError: refused to load {culprit}"
        assert refused is not None and refused.startswith(expected), (rank, refused, out[-3000:])
    assert not marker.exists()
    after = torch.load(tmp_path / "after_refusal.pt", weights_only=True)
    assert max_diff(after, train_single_device("mlp", 0, steps=2).state_dict()) <= 1e-5
