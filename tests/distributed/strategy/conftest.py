"""One launch of tests/workers/user_code.py for the checks of several kinds of everyday user code
(issue 40): each launch costs seconds of CI, each test reads its own runs."""

import pytest

from tests.distributed.strategy.test_step_outputs import _job

# run name -> tests/workers/user_code.py run (the epoch runs' ModelCheckpoint dirpath is added below)
KINDS = {
    "epoch_gpipe": {"case": "epoch", "strategy": {"chunks": 2}},
    "epoch_1f1b": {"case": "epoch", "strategy": {"chunks": 2, "schedule": "1f1b"}},
    "batchnorm_gpipe": {"case": "batchnorm", "strategy": {"batch_norm": "micro_batch"}},
    "batchnorm_1f1b": {"case": "batchnorm", "strategy": {"schedule": "1f1b", "batch_norm": "micro_batch"}},
}


@pytest.fixture(scope="session")
def kinds_job(tmp_path_factory):
    """:data:`KINDS` in one 2-rank job; per run name, every rank's record (rank 0: the last stage)."""
    tmp = tmp_path_factory.mktemp("kinds")
    runs = [dict(run) for run in KINDS.values()]
    for name, run in zip(KINDS, runs):
        if run["case"] == "epoch":
            run["trainer"] = {"dirpath": str(tmp / name)}
    return dict(zip(KINDS, _job(tmp, runs, timeout=240)))
