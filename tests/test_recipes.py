"""The main job: Hydra configs compose and build, ``recipes/train.py`` trains, sweeps stay per job.

End-to-end runs go through the CLI in a subprocess (Lightning starts rank 1 by re-running the
command) under a hard timeout, on tiny sizes.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import uuid
from collections import Counter
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from lightning_gpipe import GPipeStrategy
from recipes.train import build_data, build_strategy, num_devices, summary
from tests._harness import ROOT, check, run_script

CONF = ROOT / "conf"
GROUPS = {
    group: sorted(path.stem for path in (CONF / group).glob("*.yaml"))
    for group in ("model", "data", "pipeline", "trainer", "experiment")
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="the transformers recipes need the [models] extra"
)
# Hugging Face transformers models built from config (recipes.modules.HFLanguageModel / HFImageClassifier)
HF_MODELS = ["gpt2", "llama", "resnet", "vit"]
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


def _compose(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra)


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


# -- configs ---------------------------------------------------------------------------------------


def test_config_groups_hold_the_documented_options():
    assert GROUPS["model"] == ["amoebanet", "gpt2", "llama", "resnet", "transformer", "vit"]
    assert GROUPS["data"] == ["cifar10", "digits", "text"]
    assert GROUPS["trainer"] == ["cpu", "gpu"]
    assert "default" in GROUPS["pipeline"]
    cfg = _compose()
    assert cfg.model._target_ == "recipes.modules.LanguageModel"
    assert cfg.data._target_ == "recipes.data.ByteTextDataModule"
    assert (cfg.pipeline.pipeline_parallel_size, cfg.trainer.accelerator) == (2, "cpu")


@pytest.mark.parametrize("model, data", PAIRS)
def test_model_and_data_configs_instantiate(model, data, tmp_path):
    cfg = _compose(
        f"model={model}", f"data={data}", f"data.root={tmp_path}" if data == "cifar10" else "seed=0"
    )
    datamodule = build_data(cfg.data)
    net = instantiate(cfg.model, _convert_="all")
    assert isinstance(datamodule, get_class(cfg.data._target_))
    assert isinstance(net, get_class(cfg.model._target_))
    if model == "amoebanet":
        assert net.hparams["num_classes"] == datamodule.num_classes == 10
        assert net.hparams["in_channels"] == cfg.data.channels
    elif model == "transformer":
        assert net.hparams["vocab_size"] == datamodule.vocab_size
        assert net.hparams["seq_len"] == datamodule.seq_len
    else:  # a transformers model: its config matches the data, the Sequential holds its parameters
        config = net.hf.config
        assert {id(p) for p in net.layers.parameters()} == {id(p) for p in net.hf.parameters()}
        if data == "text":
            assert config.vocab_size == datamodule.vocab_size == 256
            positions = config.n_positions if model == "gpt2" else config.max_position_embeddings
            assert positions == datamodule.seq_len
        else:
            assert config.num_labels == datamodule.num_classes == 10
            assert config.num_channels == cfg.data.channels
            if model == "vit":
                assert config.image_size == cfg.data.resolution == 32


@pytest.mark.parametrize("pipeline", GROUPS["pipeline"])
def test_pipeline_config_builds_the_strategy(pipeline):
    cfg = _compose(f"pipeline={pipeline}", "pipeline.chunks=32", "pipeline.balance=[4,3]")
    strategy = build_strategy(cfg.pipeline)
    assert isinstance(strategy, GPipeStrategy)
    assert (strategy.chunks, strategy.balance, strategy.checkpoint) == (32, [4, 3], cfg.pipeline.checkpoint)
    assert strategy.pipeline_parallel_size == cfg.pipeline.pipeline_parallel_size


def test_every_strategy_argument_is_settable_from_the_pipeline_config():
    cfg = _compose(
        "pipeline.checkpoint_format=sharded",
        "pipeline.module_name=layers",
        "pipeline.timeline=true",
        "pipeline.timeline_dir=spans",
        "pipeline.optimizer_state_factor=1.0",
        "pipeline.timeout.minutes=5",
        "pipeline.deferred_batch_norm=true",
        "pipeline.schedule=1f1b",
    )
    strategy = build_strategy(cfg.pipeline)
    assert (strategy.checkpoint_format, strategy.module_name, strategy.timeline_dir) == (
        "sharded",
        "layers",
        "spans",
    )
    assert strategy.timeline and strategy.deferred_batch_norm and strategy.optimizer_state_factor == 1.0
    assert strategy._timeout.total_seconds() == 300
    assert strategy.schedule == "1f1b"


@pytest.mark.parametrize(
    "key", ["pipeline.stages=4", "pipeline.checkpoint_formats=sharded", "pipeline.accelerator=cpu"]
)
def test_unknown_pipeline_key_is_an_error(key):
    cfg = _compose("+" + key)
    with pytest.raises(
        ValueError, match=r"pipeline config has keys that are not GPipeStrategy arguments \(unknown: \['"
    ):
        build_strategy(cfg.pipeline)


def test_processes_come_from_the_pipeline_config():
    assert num_devices(_compose("pipeline.pipeline_parallel_size=3", "pipeline.replicas=2")) == 6
    assert num_devices(_compose("pipeline.replicas=2", "trainer.num_nodes=2")) == 2
    assert num_devices(_compose("+trainer.devices=2")) == 2  # agrees: accepted
    with pytest.raises(
        ValueError, match=r"trainer.devices disagrees with the pipeline config \(trainer.devices: 4, "
    ):
        num_devices(_compose("+trainer.devices=4"))
    with pytest.raises(ValueError, match=r"do not divide evenly over the nodes"):
        num_devices(_compose("pipeline.pipeline_parallel_size=3", "trainer.num_nodes=2"))


@pytest.mark.parametrize("trainer", GROUPS["trainer"])
def test_trainer_configs_instantiate(trainer):
    cfg = _compose(f"trainer={trainer}")
    assert get_class(cfg.trainer._target_).__name__ == "Trainer"
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        pytest.skip("no CUDA device to build a GPU Trainer on")
    built = instantiate(cfg.trainer, devices=1, logger=False, enable_checkpointing=False)
    assert built.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("experiment", GROUPS["experiment"])
def test_experiments_compose_and_build(experiment, tmp_path):
    cfg = _compose(f"experiment={experiment}", f"data.root={tmp_path}" if "cifar" in experiment else "seed=0")
    assert cfg.task_name == experiment
    build_data(cfg.data)
    build_strategy(cfg.pipeline)
    with torch.device("meta"):  # paper-sized models: shapes only
        net = instantiate(cfg.model, _convert_="all")
    assert len(net.layers) >= cfg.pipeline.pipeline_parallel_size


def _parameters(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in instantiate(cfg.model, _convert_="all").parameters())


def test_transformer_l_matches_gpipe_table_1():
    # GPipe (arXiv 1811.06965) Table 1: Transformer-L with L = 3 has 282.2 M and L = 13 785.8 M parameters
    # (32k vocabulary, untied embedding and head; ours adds a 512 × 2048 position table, 1.05 M).
    for layers, millions in ((3, 282.2), (13, 785.8)):
        cfg = _compose("experiment=transformer_l_k2", f"model.num_layers={layers}")
        assert _parameters(cfg) / 1e6 == pytest.approx(millions + 512 * 2048 / 1e6, abs=0.2)


def test_amoebanet_experiment_matches_gpipe_table_1():
    # GPipe Table 1, "Pipeline-2": AmoebaNet-D (18, 544) with 542 M parameters (1,000 classes).
    cfg = _compose("experiment=amoebanet_k2", "data.num_classes=1000", "data.root=.")
    assert (cfg.model.num_layers, cfg.model.num_filters) == (18, 544)
    assert _parameters(cfg) / 1e6 == pytest.approx(542, abs=1)


def test_data_paths_resolve_against_the_start_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _compose("data.path=corpus.txt")
    assert build_data(cfg.data).path == str(tmp_path / "corpus.txt")
    cfg = _compose("model=amoebanet", "data=cifar10", "data.root=cifar")
    assert build_data(cfg.data).root == str(tmp_path / "cifar")


def test_descriptive_data_key_must_match_the_data_module():
    cfg = _compose("model=amoebanet", "data=digits", "data.num_classes=100")
    with pytest.raises(ValueError, match=r"data.num_classes does not match DigitsDataModule.num_classes"):
        build_data(cfg.data)


def test_summary_lists_only_files_that_exist(tmp_path):
    metrics = {"throughput": float("nan"), "stages": 2.0, "chunks": 4.0, "wall_s": 3.0, "train_loss": 1.0}
    (tmp_path / "train.log").write_text("")
    text = summary(metrics, tmp_path, best_path="", window=20)
    assert text.splitlines()[-1] == f"[train] outputs in {tmp_path}: train.log"
    assert "throughput not measured (fewer than 20 training batches logged)" in text
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_text("")
    (tmp_path / "metrics.csv").write_text("")
    text = summary(
        dict(metrics, throughput=123.0), tmp_path, best_path=str(tmp_path / "gone.ckpt"), window=20
    )
    assert (
        text.splitlines()[-1]
        == f"[train] outputs in {tmp_path}: checkpoints/ (last.ckpt), metrics.csv, train.log"
    )
    assert "123 samples/s over the last 20 training batches" in text


# -- end to end (2 processes per job) --------------------------------------------------------------


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
    if model in ("gpt2", "llama"):
        return [f"data.path={_corpus(tmp_path)}", "data.batch_size=16"]
    return ["data=digits", "data.batch_size=16"]


@needs_transformers
@pytest.mark.parametrize("model", HF_MODELS)
def test_transformers_configs_train_on_one_device(model, tmp_path):
    # each config builds and fits a few steps (plain Lightning, one process): training the adapter's
    # Sequential trains the transformers model itself
    cfg = _compose(f"model={model}", *_hf_data(model, tmp_path), "model.warmup_steps=1")
    datamodule = build_data(cfg.data)
    net = instantiate(cfg.model, _convert_="all")
    before = {k: v.clone() for k, v in net.hf.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=1,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(net, datamodule=datamodule)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    moved = [k for k, v in net.hf.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) > len(before) // 2, moved
    x = next(iter(datamodule.val_dataloader()))[0][:2]
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x), net.hf(x).logits, rtol=0, atol=1e-5)


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
@pytest.mark.parametrize("model", ["llama", "resnet", "vit"])
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


@pytest.mark.timeout(240)
def test_multirun_gives_each_job_its_own_processes_and_directory(tmp_path):
    task = f"pytest_sweep_{uuid.uuid4().hex[:8]}"  # a stray directory would be outputs/<task>/...
    sweep = tmp_path / "sweep"
    out = check(
        run_script(
            "recipes/train.py",
            "-m",
            "pipeline.chunks=1,2",
            f"data.path={_corpus(tmp_path)}",  # relative to the start directory, with chdir=true
            "hydra.job.chdir=true",
            f"task_name={task}",
            f"hydra.sweep.dir={sweep}",
            *TINY["transformer"],
            *FAST,
            timeout=220,
        )
    )
    assert out.count("[train] 2 stages,") == 2, out[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    for job, chunks in (("0", 1), ("1", 2)):
        job_dir = sweep / job
        config = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
        hparams = yaml.safe_load((job_dir / "hparams.yaml").read_text())
        assert config["pipeline"]["chunks"] == hparams["chunks"] == chunks
        losses = _train_losses(job_dir)
        assert len(losses) >= 10 and sum(losses[-4:]) < sum(losses[:4]), losses  # the main job learns
        assert (job_dir / "checkpoints" / "last.ckpt").is_file()
        subdirs = {p.name for p in job_dir.iterdir() if p.is_dir()}
        assert {".hydra", "checkpoints"} <= subdirs <= {".hydra", "checkpoints", "tensorboard"}
    assert not any((ROOT / top / task).exists() for top in ("outputs", "multirun"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "sweep"]
    assert OmegaConf.load(sweep / "multirun.yaml").hydra.mode == "MULTIRUN"


@pytest.mark.parametrize("trainer, gpus", [("gpu", 2), ("cpu", None)])
def test_slurm_launcher_asks_for_one_task_per_process_of_the_job(trainer, gpus):
    cfg = _compose(
        "hydra/launcher=gpipe_slurm",
        f"trainer={trainer}",
        "pipeline.replicas=2",
        "trainer.num_nodes=2",
        hydra=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 2, gpus)
    local = _compose("hydra/launcher=gpipe_local", hydra=True).hydra.launcher
    assert local._target_.endswith("LocalLauncher") and (local.nodes, local.tasks_per_node) == (1, 2)


def test_schedule_and_virtual_stages_come_from_the_pipeline_config():
    cfg = _compose(
        "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.balance=[2,1,1,1]"
    )
    strategy = build_strategy(cfg.pipeline)
    assert (strategy.schedule, strategy.virtual_stages, strategy.balance) == (
        "interleaved_1f1b",
        2,
        [2, 1, 1, 1],
    )
    default = build_strategy(_compose().pipeline)
    assert (default.schedule, default.virtual_stages) == ("gpipe", 1)
    with pytest.raises(InstantiationException, match=r"gpipe schedule runs one virtual stage per stage"):
        build_strategy(_compose("pipeline.virtual_stages=2").pipeline)


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
