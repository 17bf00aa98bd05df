"""The main job: Hydra configs compose and build, ``recipes/train.py`` trains, sweeps stay per job.

End-to-end runs go through the CLI in a subprocess (Lightning starts rank 1 by re-running the
command) under a hard timeout, on tiny sizes.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from tests._harness import ROOT, _env, check, run_script

CONF = ROOT / "conf"


GROUPS = {
    group: sorted(path.stem for path in (CONF / group).glob("*.yaml"))
    for group in ("model", "data", "pipeline", "trainer", "experiment")
}


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="the transformers recipes need the [models] extra"
)


# model -> the data configs it can read its sizes from
PAIRS = [("transformer", "text"), ("amoebanet", "digits"), ("amoebanet", "cifar10")] + [
    pytest.param(model, data, marks=needs_transformers)
    for model, data in [("gpt2", "text"), ("llama", "text")]
    + [(model, data) for model in ("resnet", "vit") for data in ("digits", "cifar10")]
]


TINY = {
    "transformer": ["model.num_layers=2", "model.d_model=32", "model.d_ff=64", "data.batch_size=16"],
    "amoebanet": ["model.num_filters=16", "data.batch_size=16"],
}


FAST = [
    "model.warmup_steps=2",
    "trainer.max_steps=16",
    "trainer.val_check_interval=8",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "throughput_window=2",
]


def _corpus(tmp_path: Path) -> str:
    """A small text file; returns its path relative to the repository root (the jobs' start directory)."""
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(2000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return os.path.relpath(path, ROOT)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def _train_losses(job_dir: Path) -> list[float]:
    return [float(row["train_loss"]) for row in _rows(job_dir / "metrics.csv") if row.get("train_loss")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "model",
    [
        # the transformer's main job learns and saves in the default suite's multirun test
        pytest.param("transformer", marks=pytest.mark.slow),
        pytest.param("amoebanet", marks=pytest.mark.slow),  # about 25 s
    ],
)
def test_train_two_stages_loss_falls(model, tmp_path):
    # AmoebaNet also chooses its balance by profiled time, and (BatchNorm) runs deferred batch norm
    data = (
        [f"data.path={_corpus(tmp_path)}"]
        if model == "transformer"
        else ["data=digits", "pipeline.balance=time"]
    )
    out = check(
        run_script(
            "recipes/train.py",
            f"model={model}",
            *data,
            *TINY[model],
            *FAST,
            f"hydra.run.dir={tmp_path / 'run'}",
            timeout=180,
        )
    )
    assert "[train] 2 stages, 4 chunks:" in out, out[-3000:]
    losses = _train_losses(tmp_path / "run")
    assert len(losses) >= 10 and sum(losses[-4:]) < sum(losses[:4]), (
        losses
    )  # noisy per step: compare quarters
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    if model == "amoebanet":
        assert "gpipe: balance='time' chose [" in out, out[-3000:]
        hparams = (tmp_path / "run" / "hparams.yaml").read_text()
        assert "gpipe_balance" in hparams, hparams
        saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["gpipe"]
        assert saved["balance_by"] == "time" and len(saved["balance"]) == 2


def _hf_data(model: str, tmp_path: Path) -> list[str]:
    if model == "hf":  # a family with sliding windows and soft-capping, on padded batches with masks
        return [
            "model.family=gemma2",
            "data=text_sft",
            f"data.path={_corpus(tmp_path)}",
            "data.batch_size=16",
        ]
    if model in ("gpt2", "llama"):
        return [f"data.path={_corpus(tmp_path)}", "data.batch_size=16"]
    return ["data=digits", "data.batch_size=16"]


def _val_windows(corpus: Path, seq_len: int, batches: int, batch_size: int) -> tuple[float, torch.Tensor]:
    """The validation split of ``ByteTextDataModule`` (last 10 % of the bytes), recomputed here: its
    unigram entropy (nats/byte, from a Counter) and its first windows ``(batches·batch_size, T + 1)``."""
    data = corpus.read_bytes()
    val = data[len(data) - math.ceil(len(data) * 0.1) :]
    counts = Counter(val)
    entropy = -sum(c / len(val) * math.log(c / len(val)) for c in counts.values())
    ids = torch.tensor(list(val), dtype=torch.int64)
    starts = range(0, (len(ids) - seq_len - 1) // seq_len * seq_len + 1, seq_len)
    windows = torch.stack([ids[i : i + seq_len + 1] for i in starts][: batches * batch_size])
    return entropy, windows


@needs_transformers
@pytest.mark.timeout(240)
def test_gpt2_recipe_goes_below_the_unigram_entropy_and_maps_back(tmp_path):
    # model=gpt2 over 2 stages (the tied embedding and head on different stages), chunks 8
    from transformers import GPT2LMHeadModel

    from recipes.models.hf import hf_from_checkpoint

    corpus = _corpus(tmp_path)
    out = check(
        run_script(
            "recipes/train.py",
            "model=gpt2",
            f"data.path={corpus}",
            "data.batch_size=16",
            "pipeline.chunks=8",
            "model.lr=1e-2",
            *FAST,
            "trainer.max_steps=40",
            "trainer.val_check_interval=20",
            "trainer.limit_val_batches=4",
            f"hydra.run.dir={tmp_path / 'run'}",
            timeout=220,
        )
    )
    assert "[train] 2 stages, 8 chunks:" in out, out[-3000:]
    rows = _rows(tmp_path / "run" / "metrics.csv")
    logged_entropy = [float(r["val_unigram_entropy"]) for r in rows if r.get("val_unigram_entropy")]
    val_losses = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    entropy, windows = _val_windows(ROOT / corpus, seq_len=64, batches=4, batch_size=16)
    assert logged_entropy == [pytest.approx(entropy, abs=1e-6)]
    assert len(val_losses) == 2 and val_losses[-1] < entropy, (val_losses, entropy)
    # the checkpoint maps back into the transformers model (strict=True), which computes the logged val_loss
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    hf = hf_from_checkpoint(ckpt).eval()
    assert isinstance(hf, GPT2LMHeadModel) and hf.lm_head.weight is hf.transformer.wte.weight
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert loss.item() == pytest.approx(val_losses[-1], abs=1e-4)


@needs_transformers
@pytest.mark.slow  # about a minute each on 2 busy cores
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["llama", "hf", "resnet", "vit"])
def test_transformers_recipe_trains_over_two_stages_and_maps_back(model, tmp_path):
    from recipes.models.hf import hf_from_checkpoint, hf_sequential

    out = check(
        run_script(
            "recipes/train.py",
            f"model={model}",
            *_hf_data(model, tmp_path),
            *FAST,
            "trainer.max_steps=48",
            "trainer.val_check_interval=24",
            f"hydra.run.dir={tmp_path / 'run'}",
            timeout=220,
        )
    )
    assert "[train] 2 stages, 4 chunks:" in out, out[-3000:]
    losses = _train_losses(tmp_path / "run")
    assert len(losses) >= 40 and sum(losses[-8:]) < sum(losses[:8]), losses  # noisy per step
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    hf = hf_from_checkpoint(ckpt)  # strict=True inside
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    ours = {id(t): k for k, t in hf.state_dict(keep_vars=True).items()}
    for key, tensor in hf_sequential(hf).state_dict(keep_vars=True).items():
        torch.testing.assert_close(tensor, saved[f"layers.{key}"], rtol=0, atol=0, msg=ours[id(tensor)])


def _logged(job_dir: Path, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row of ``metrics.csv`` with a value in column ``key``."""
    return [(int(row["step"]), float(row[key])) for row in _rows(job_dir / "metrics.csv") if row.get(key)]


@pytest.mark.timeout(400)
def test_multirun_jobs_run_apart_and_a_stopped_job_resumes_in_its_directory_exactly(tmp_path):
    """``-m trainer.max_steps=7,16``: two 2-process jobs, each in its own directory (with
    ``hydra.job.chdir=true`` and a relative data path), the ranks of each running its own overrides.
    Job 0 is the 16-step run stopped at step 7 (``model.total_steps=16`` keeps its schedule; the
    last checkpoint of a job stopped later is one of every 3 steps); ``hydra.run.dir=<job 0>
    ckpt_path=last`` resumes it in its directory to the end. Its ``metrics.csv`` continues, its
    best checkpoint stays in its ``checkpoints/``, no other directory appears, and every logged
    loss and final weight equals job 1's, which ran uninterrupted (issue 41, item 6)."""
    task = f"pytest_sweep_{uuid.uuid4().hex[:8]}"  # a stray directory would be outputs/<task>/...
    sweep = tmp_path / "sweep"
    common = [
        f"data.path={_corpus(tmp_path)}",  # relative to the start directory, with chdir=true
        "hydra.job.chdir=true",
        f"task_name={task}",
        *TINY["transformer"],
        *(arg for arg in FAST if not arg.startswith("trainer.max_steps=")),
        "model.total_steps=16",
        "checkpoint.every_n_steps=3",
    ]
    out = check(
        run_script(
            "recipes/train.py",
            "-m",
            "trainer.max_steps=7,16",
            f"hydra.sweep.dir={sweep}",
            *common,
            timeout=220,
        )
    )
    assert out.count("[train] 2 stages,") == 2, out[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    for job, steps in (("0", 7), ("1", 16)):
        config = yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())
        assert config["trainer"]["max_steps"] == steps
        assert _logged(sweep / job, "train_loss")[-1][0] == steps - 1  # the ranks ran this job's steps
    stopped = torch.load(sweep / "0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert stopped["global_step"] == 7
    interval = [v for k, v in stopped["callbacks"].items() if "'every_n_train_steps': 3" in k]
    assert len(interval) == 1 and interval[0]["last_model_path"].endswith("last.ckpt"), stopped["callbacks"]

    out = check(
        run_script(
            "recipes/train.py",
            f"hydra.run.dir={sweep / '0'}",
            "ckpt_path=last",
            "trainer.max_steps=16",
            *common,
            timeout=220,
        )
    )
    assert "Restoring states from the checkpoint path at" in out, out[-3000:]
    resumed, whole = sweep / "0", sweep / "1"
    for key in ("train_loss", "val_loss", "val_unigram_entropy"):
        assert _logged(resumed, key) == _logged(whole, key), key
    assert [step for step, _ in _logged(resumed, "train_loss")] == list(range(16))  # one row a step
    ours = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)
    theirs = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False)
    assert ours["global_step"] == theirs["global_step"] == 16
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, rtol=0, atol=0, msg=key)
    best = [v for k, v in ours["callbacks"].items() if "'monitor': 'val_loss'" in k][0]
    best_whole = [v for k, v in theirs["callbacks"].items() if "'monitor': 'val_loss'" in k][0]
    assert best["best_model_score"] == best_whole["best_model_score"]
    kept = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert kept == sorted([Path(best["best_model_path"]).name, "last.ckpt"]), kept  # one best, here
    assert Path(best["best_model_path"]).parent == (resumed / "checkpoints").resolve()
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    assert not any((ROOT / top / task).exists() for top in ("outputs", "multirun"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "sweep"]
    assert OmegaConf.load(sweep / "multirun.yaml").hydra.mode == "MULTIRUN"
    for job in ("0", "1"):
        subdirs = {p.name for p in (sweep / job).iterdir() if p.is_dir()}
        assert {".hydra", "checkpoints"} <= subdirs <= {".hydra", "checkpoints", "tensorboard"}
        losses = _train_losses(sweep / job)
        assert sum(losses[-4:]) < sum(losses[:4]), losses  # the main job learns


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun_over_schedules_trains_the_main_job_under_each(tmp_path):
    """``-m pipeline.schedule=gpipe,1f1b,interleaved_1f1b``: one 2-process job per schedule, each trains
    (interleaved with its default of 2 virtual stages per stage)."""
    sweep = tmp_path / "sweep"
    out = check(
        run_script(
            "recipes/train.py",
            "-m",
            "pipeline.schedule=gpipe,1f1b,interleaved_1f1b",
            f"data.path={_corpus(tmp_path)}",
            f"hydra.sweep.dir={sweep}",
            *TINY["transformer"],
            *FAST,
            timeout=280,
        )
    )
    assert out.count("[train] 2 stages,") == 3, out[-3000:]
    assert "2 stages × 2 virtual stages" in out, out[-3000:]
    for job, schedule in (("0", "gpipe"), ("1", "1f1b"), ("2", "interleaved_1f1b")):
        config = yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())
        assert config["pipeline"]["schedule"] == schedule
        losses = _train_losses(sweep / job)
        assert len(losses) >= 10 and sum(losses[-4:]) < sum(losses[:4]), (schedule, losses)


def _sigterm_when_saved(command: list[str], saved: Path, timeout: float) -> tuple[int, str]:
    """Run ``command`` (a job Lightning's launcher starts) in a session of its own, send its launching
    rank SIGTERM once ``saved`` exists, as a scheduler would; returns its exit code and output."""
    log = saved.parent.parent.with_suffix(".log")
    with log.open("w") as handle:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        try:
            while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the job is left (nothing, when it passed)
    return code, log.read_text()


@pytest.mark.slow  # about a minute on 2 cores: three launches of the recipe
@pytest.mark.timeout(400)
def test_a_job_stopped_by_sigterm_resumes_from_the_step_it_stopped_at_exactly(tmp_path):
    """SIGTERM to the launching rank once the step-20 ``last.ckpt`` exists: every rank stops at one
    step boundary after it, exits 143 and ``last.ckpt`` holds that step (recipes.last_checkpoint);
    ``ckpt_path=last`` resumes there and ends with every logged loss and weight of a run that was
    never stopped."""
    common = [
        sys.executable,
        str(ROOT / "recipes" / "train.py"),
        f"data.path={_corpus(tmp_path)}",
        *TINY["transformer"],
        *(arg for arg in FAST if not arg.startswith(("trainer.max_steps=", "trainer.val_check_interval="))),
        "trainer.max_steps=120",
        "model.total_steps=120",
        "trainer.val_check_interval=40",
        "checkpoint.every_n_steps=20",
    ]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    last = stopped / "checkpoints" / "last.ckpt"
    code, out = _sigterm_when_saved([*common, f"hydra.run.dir={stopped}"], last, timeout=200)
    assert code == 143, out[-3000:]
    assert out.count("stopped on SIGTERM with every rank") == 2, out[-3000:]
    step = torch.load(last, weights_only=False)["global_step"]
    assert 20 < step < 120, step  # written where the signal stopped the job, after the interval's step 20
    check(
        run_script("recipes/train.py", *common[2:], f"hydra.run.dir={stopped}", "ckpt_path=last", timeout=200)
    )
    check(run_script("recipes/train.py", *common[2:], f"hydra.run.dir={whole}", timeout=200))
    for key in ("train_loss", "val_loss"):
        assert _logged(stopped, key) == _logged(whole, key), key
    ours = torch.load(last, weights_only=False)
    theirs = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False)
    assert ours["global_step"] == theirs["global_step"] == 120
    for key, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, rtol=0, atol=0, msg=key)
