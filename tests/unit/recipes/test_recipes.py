"""The main job: Hydra configs compose and build, ``recipes/train.py`` trains, sweeps stay per job.

End-to-end runs go through the CLI in a subprocess (Lightning starts rank 1 by re-running the
command) under a hard timeout, on tiny sizes.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate

from lightning_gpipe import GPipeStrategy
from recipes.last_checkpoint import LastCheckpoint
from recipes.train import build_data, build_strategy, checkpoint_callbacks, num_devices, summary
from tests._harness import ROOT, _env
from tests.launch import run_job

CONF = ROOT / "conf"


GROUPS = {
    group: sorted(path.stem for path in (CONF / group).glob("*.yaml"))
    for group in ("model", "data", "pipeline", "trainer", "experiment")
}


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="the transformers recipes need the [models] extra"
)


# Hugging Face transformers models built from config (recipes.hf_modules.HFLanguageModel / HFImageClassifier)
HF_MODELS = ["gpt2", "llama", "resnet", "vit"]


# model -> the data configs it can read its sizes from
PAIRS = [("transformer", "text"), ("amoebanet", "digits"), ("amoebanet", "cifar10")] + [
    pytest.param(model, data, marks=needs_transformers)
    for model, data in [("gpt2", "text"), ("llama", "text"), ("hf", "text"), ("hf", "text_sft")]
    + [(model, data) for model in ("resnet", "vit") for data in ("digits", "cifar10")]
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


def test_config_groups_hold_the_documented_options():
    assert GROUPS["model"] == ["amoebanet", "gpt2", "hf", "llama", "resnet", "transformer", "vit"]
    assert GROUPS["data"] == ["cifar10", "digits", "text", "text_sft"]
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
        if data.startswith("text"):
            assert config.vocab_size == datamodule.vocab_size == 256
            positions = config.n_positions if model == "gpt2" else config.max_position_embeddings
            assert data != "text_sft" or isinstance(datamodule, get_class("recipes.data.ByteSFTDataModule"))
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
    assert (
        strategy.batch_norm == "micro_batch"
    )  # the recipes train BatchNorm models (AmoebaNet) as GPipe does


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
        "pipeline.batch_norm=batch",
    )
    strategy = build_strategy(cfg.pipeline)
    assert (strategy.checkpoint_format, strategy.module_name, strategy.timeline_dir) == (
        "sharded",
        "layers",
        "spans",
    )
    assert strategy.timeline and strategy.deferred_batch_norm and strategy.optimizer_state_factor == 1.0
    assert strategy._timeout.total_seconds() == 300
    assert strategy.schedule == "1f1b" and strategy.batch_norm == "batch"


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


def _hf_data(model: str, tmp_path: Path) -> list[str]:
    if model in ("gpt2", "llama"):
        return [f"data.path={_corpus(tmp_path)}", "data.batch_size=16"]
    return ["data=digits", "data.batch_size=16"]


def _fit_few_steps(net, datamodule) -> pl.Trainer:
    """Fit ``net`` (a recipe module on a transformers model, ``net.hf``) 3 steps with one validation on
    one device; its validation loss is finite and more than half of the model's tensors moved."""
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
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    moved = [k for k, v in net.hf.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) > len(before) // 2, moved
    return trainer


@needs_transformers
@pytest.mark.parametrize("model", HF_MODELS)
def test_transformers_configs_train_on_one_device(model, tmp_path):
    # each config builds and fits a few steps (plain Lightning, one process): training the adapter's
    # Sequential trains the transformers model itself
    cfg = _compose(f"model={model}", *_hf_data(model, tmp_path), "model.warmup_steps=1")
    datamodule = build_data(cfg.data)
    net = instantiate(cfg.model, _convert_="all")
    trainer = _fit_few_steps(net, datamodule)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    x = next(iter(datamodule.val_dataloader()))[0][:2]
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x), net.hf(x).logits, rtol=0, atol=1e-5)


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_any_plan_family_trains_on_padded_batches_with_the_models_own_masked_loss(family, tmp_path):
    # model=hf model.family=<name> data=text_sft: a tiny random model of the family (gemma2: sliding
    # windows of 3 tokens and soft-capping) trains on left- and right-padded batches; the
    # Sequential's logits on real tokens are the transformers model's own with the same mask, and
    # the step's loss is the mean over real tokens returned with their count
    cfg = _compose(
        "model=hf",
        f"model.family={family}",
        "data=text_sft",
        f"data.path={_corpus(tmp_path)}",
        "data.batch_size=8",
        "data.seq_len=24",
        "model.warmup_steps=1",
    )
    datamodule = build_data(cfg.data)
    net = instantiate(cfg.model, _convert_="all")
    assert net.hf.config.model_type == family and net.hparams["family"] == family
    x, labels = next(iter(datamodule.val_dataloader()))
    mask = x["attention_mask"].bool()
    assert not mask[:, 0].all() and not mask[:, -1].all()  # left and right padding in one batch
    out = net.training_step((x, labels), 0)
    with torch.no_grad():
        hf_logits = net.hf(**x).logits
    real = labels != -100
    expected = torch.nn.functional.cross_entropy(hf_logits[real], labels[real])
    torch.testing.assert_close(out["loss"].detach(), expected, rtol=0, atol=1e-5)
    assert int(out["num_items"]) == int(real.sum()) == int(mask.sum())
    _fit_few_steps(net, datamodule)
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x)[mask], net.hf(**x).logits[mask], rtol=0, atol=1e-5)


@needs_transformers
def test_an_unknown_family_is_refused_with_the_list():
    cfg = _compose("model=hf", "model.family=gpt5")
    refused = r"model.family must be a causal-LM family .* \(family: 'gpt5'\); one of \[.*'llama'"
    with pytest.raises(InstantiationException, match=refused):
        instantiate(cfg.model, _convert_="all")


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


def test_last_checkpoint_is_written_on_the_configured_interval_from_the_start(tmp_path):
    best, interval = checkpoint_callbacks(_compose(), tmp_path, "val_loss")
    assert best.monitor == "val_loss" and best.save_last and best.dirpath == str(tmp_path / "checkpoints")
    assert isinstance(interval, LastCheckpoint) and interval._every_n_train_steps == 25
    assert interval.save_last and interval.save_top_k == 0
    assert interval.dirpath == best.dirpath and not best._enable_version_counter  # one last.ckpt
    timed = checkpoint_callbacks(
        _compose("checkpoint.every_n_steps=null", "checkpoint.every_minutes=0.5"), tmp_path, None
    )
    assert timed[1]._train_time_interval.total_seconds() == 30.0
    _, signal_only = checkpoint_callbacks(_compose("checkpoint.every_n_steps=null"), tmp_path, "val_loss")
    assert (signal_only._every_n_train_steps, signal_only._every_n_epochs) == (0, 0)  # no interval
    assert signal_only._train_time_interval is None
    for large in ("transformer_l_k2", "amoebanet_k2"):  # a large model's save takes seconds: by time
        _, interval = checkpoint_callbacks(_compose(f"experiment={large}"), tmp_path, "val_loss")
        assert interval._train_time_interval.total_seconds() == 600.0 and interval._every_n_train_steps == 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["checkpoint.every_minutes=5"], r"set one of checkpoint.every_n_steps and checkpoint.every_minutes"),
        (["checkpoint.every_n_steps=0"], r"checkpoint.every_n_steps must be positive or null"),
    ],
)
def test_bad_checkpoint_interval_is_an_error_naming_the_key(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        checkpoint_callbacks(_compose(*overrides), tmp_path, "val_loss")


_WITHOUT_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None  # as where the [models] extra is not installed: its import fails
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
import recipes.train  # noqa: F401
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="train", overrides=["model.num_layers=2", "model.d_model=16", "model.d_ff=32"])
model = instantiate(cfg.model)
print("built", type(model).__name__, sum(p.numel() for p in model.parameters()))
"""


def test_the_main_job_needs_no_transformers(tmp_path):
    """The README's first command installs the ``[recipes]`` extra only: the default recipe and its model
    import and build with ``transformers`` missing (the ``HF`` modules live apart, in recipes.hf_modules)."""
    script = tmp_path / "without_transformers.py"
    script.write_text(_WITHOUT_TRANSFORMERS)
    rc, out = run_job([sys.executable, str(script), str(CONF)], cwd=ROOT, env=_env(), timeout=120)[0]
    assert rc == 0 and "built LanguageModel" in out, out[-3000:]
