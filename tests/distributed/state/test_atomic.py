"""Every rank killed (SIGKILL) in each phase of a save, in both formats, with ``$TMPDIR`` on another
filesystem (a tmpfs, ``/dev/shm``): the last good checkpoint loads every time, nothing is staged in
``$TMPDIR``, and the next save removes what the killed one left (issue 41, item 2).

The jobs (tests/workers/faults.py, 2 stages, torchrun-style) save ``c.ckpt`` after every step; in the
save of step 2, rank 0, which commits, kills every rank at one point of
:mod:`lightning_gpipe.state.atomic`'s sequence. tests/unit/state/test_atomic.py raises at the same
points in one process.
"""

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.state import atomic
from lightning_gpipe.state.sharded import save_sharded
from lightning_gpipe.strategy import checkpoints
from tests._harness import run_ranks
from tests.models import Net

SHM = Path("/dev/shm")

# (format, where the kill comes, the global_step that loads): the full save's one os.replace; the
# sharded save's three: 1 lightning_meta.pt into the staged directory, 2 the old checkpoint aside,
# 3 the staged directory to the path
_PHASES = [
    pytest.param("full", {"writing": True}, 1, id="full-writing"),
    pytest.param("full", {"replace": 1, "when": "before"}, 1, id="full-staged"),
    pytest.param("full", {"replace": 1, "when": "after"}, 2, id="full-committed"),
    pytest.param("sharded", {"replace": 1, "when": "before"}, 1, id="sharded-writing"),
    pytest.param("sharded", {"replace": 2, "when": "before"}, 1, id="sharded-staged"),
    pytest.param("sharded", {"replace": 2, "when": "after"}, 2, id="sharded-between-renames"),
    pytest.param("sharded", {"replace": 3, "when": "after"}, 2, id="sharded-committed"),
]


def _load(path: Path) -> int:
    """The global step of the checkpoint at ``path``, loaded as ``fit(ckpt_path=path)`` loads it."""
    strategy = GPipeStrategy()
    strategy.connect(Net("mlp"))
    return strategy.load_checkpoint(path)["global_step"]


@pytest.mark.skipif(not SHM.is_dir(), reason="needs a tmpfs at /dev/shm")
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("checkpoint_format", "kill", "loads"), _PHASES)
def test_every_rank_killed_during_a_save_leaves_the_last_good_checkpoint(
    tmp_path, checkpoint_format, kill, loads
):
    scratch = SHM / f"gpipe-test-{uuid.uuid4().hex[:8]}"  # $TMPDIR on another filesystem
    scratch.mkdir()
    assert os.stat(scratch).st_dev != os.stat(tmp_path).st_dev
    try:
        spec = {
            "out": str(tmp_path),
            "devices": 2,
            "steps": 3,
            "strategy": {"chunks": 2, "checkpoint_format": checkpoint_format},
            "kill_in_save": {"at": 2, **kill},
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {"TMPDIR": str(scratch)}
        results = run_ranks("tests/workers/faults.py", 2, str(tmp_path / "spec.json"), timeout=120, env=env)
        where = (tmp_path / "killed").read_text() if (tmp_path / "killed").exists() else None
        assert where is not None, "\n".join(out[-3000:] for _, out in results)
        assert [code for code, _ in results] == [-9, -9], where
        assert list(scratch.iterdir()) == [], where  # nothing was staged in $TMPDIR
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    path = tmp_path / "c.ckpt"
    if checkpoint_format == "sharded" and kill == {"replace": 2, "when": "after"}:
        assert not path.exists()  # both complete copies lie beside it
        with pytest.warns(UserWarning, match=r"does not exist: a save was interrupted .* complete"):
            assert _load(path) == loads, where
    else:
        assert _load(path) == loads, where
    module = Net("mlp")  # the next save, here on one device, removes the killed save's copies
    if checkpoint_format == "full":
        checkpoint = {"state_dict": module.state_dict(), "global_step": 3}
        assert checkpoints.save("full", checkpoint, path, module, [], TorchCheckpointIO(), rank=0)
    else:
        save_sharded({"global_step": 3}, path, module, [module.configure_optimizers()])
    assert _load(path) == 3 and atomic.leftovers(path) == []
