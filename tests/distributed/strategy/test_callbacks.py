"""Lightning callbacks and hooks that see the model: the same values as one device under the gpipe
strategy."""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import Net, feature_callbacks, make_data, pl, train_single_device

SWA = {"swa_lrs": 0.05, "swa_epoch_start": 1}


EPOCHS3 = {"max_epochs": 3, "max_steps": -1}


PARAMS = 435  # tests.models "mlp": Linear(6, 16), Linear(16, 16), Linear(16, 3)


def _one_device_predictions(batch, samples):
    pl.seed_everything(0, verbose=False)
    model = Net("mlp")
    trainer = pl.Trainer(devices=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    return torch.cat(trainer.predict(model, make_data("mlp", batch, 2, seed=2, samples=samples)))


@pytest.mark.timeout(400)
def test_model_callbacks_summary_throughput_and_predictions_two_stages(gpipe_job):
    """2 stages, one job:
    - StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1), 3 epochs, and EMAWeightAveraging: the
      averaged weights equal one device's (the callbacks copied the whole module before the cut);
    - ModelSummary with example_input_array set: fit runs, the summary counts the whole model (435
      parameters) and the log says where the layers went; ThroughputMonitor logs the keys one device
      logs (samples counted once per pipeline, not once per stage);
    - predict (chunks 4, 10 samples in batches of 4) with a BasePredictionWriter("batch_and_epoch"):
      every rank returns the predictions; the writer writes on the last stage only, never gets None.
    """
    swa_ref = train_single_device(
        "mlp", 0, steps=-1, trainer_extra=EPOCHS3, callbacks=tuple(feature_callbacks({"swa": SWA}))
    )
    ema_ref = train_single_device("mlp", 0, steps=5, callbacks=tuple(feature_callbacks({"ema": {}})))
    _, tp_trainer = train_single_device(
        "mlp",
        0,
        steps=5,
        return_trainer=True,
        trainer_extra={"logger": _recorder()},
        callbacks=tuple(feature_callbacks({"throughput": {"window_size": 2}})),
    )
    expected_predictions = _one_device_predictions(4, 10)
    runs = [
        {"chunks": 2, "features": {"swa": SWA}, "trainer": EPOCHS3},
        {"chunks": 2, "features": {"ema": {}}},
        {
            "chunks": 2,
            "example_input": True,
            "record_logs": True,
            "features": {"summary": {"max_depth": 1}, "throughput": {"window_size": 2}},
            "trainer": {"enable_model_summary": True},
        },
        {"chunks": 4, "predict_only": True, "features": {"writer": {"write_interval": "batch_and_epoch"}}},
    ]
    results, _ = gpipe_job(
        "mlp", 2, runs, steps=5, batch=10, predict_batch=4, predict_samples=10, timeout=360
    )
    swa, ema, summary, predict = results
    assert max_diff(swa["state"], swa_ref.state_dict()) <= 1e-5
    assert max_diff(ema["state"], ema_ref.state_dict()) <= 1e-5
    out = summary["output"]
    assert f"{PARAMS} " in out and "Total params" in out, out[-4000:]
    assert (
        "stage 0 (rank 1): layers 0..2, 384 parameters" in out
        and "stage 1 (rank 0): layers 3..4, 51 parameters" in out
    )
    one_device_keys = set().union(*tp_trainer.logger.logged)
    for record in summary["ranks"]:
        assert set().union(*record["logged"]) == one_device_keys  # no global samples_per_sec: D = 1 pipeline
    for rank, record in enumerate(predict["ranks"]):
        assert torch.allclose(torch.cat(record["predictions"]), expected_predictions, atol=1e-6)
        ((batches, epoch),) = record["written"]
        if rank == 0:  # the last stage holds the predictions and writes them
            assert torch.allclose(torch.cat(batches), expected_predictions, atol=1e-6)
            assert torch.allclose(epoch[0], expected_predictions, atol=1e-6)
        else:
            assert batches == [] and epoch == []


def _recorder():
    from tests.models import Recorder

    return Recorder()


@pytest.mark.timeout(300)
def test_predictions_with_two_pipelines_follow_ddp(gpipe_job):
    """P=2 × D=2: each rank returns its replica's shard (as a DDP rank does); the writer writes on each
    replica's last stage (ranks 0 and 2) only; the shards together are the one-device predictions."""
    expected = _one_device_predictions(10, 10)
    runs = [{"chunks": 2, "pipeline_parallel_size": 2, "predict_only": True, "features": {"writer": {}}}]
    results, _ = gpipe_job("mlp", 4, runs, predict_batch=4, predict_samples=10)
    ranks = results[0]["ranks"]
    shards = [torch.cat(r["predictions"]) for r in ranks]
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[2], shards[3])
    # Lightning's DistributedSampler for predict: replica r takes samples r, r + 2, ... (no shuffle)
    assert torch.allclose(shards[0], expected[0::2], atol=1e-6)
    assert torch.allclose(shards[2], expected[1::2], atol=1e-6)
    written = [r["written"][0][0] for r in ranks]
    assert written[1] == [] and written[3] == []
    assert torch.allclose(torch.cat(written[0]), expected[0::2], atol=1e-6)
    assert torch.allclose(torch.cat(written[2]), expected[1::2], atol=1e-6)


@pytest.mark.timeout(300)
def test_simple_advanced_and_pytorch_profilers_report_every_rank(gpipe_job, tmp_path):
    """profiler="simple", "advanced" and "pytorch" (2 stages, validation every 2 steps for the
    pytorch profiler, whose steps then cycle while sends are in flight): each rank writes its own
    report, which names the strategy's steps."""
    runs = [
        {"chunks": 2, "profiler": "simple"},
        {"chunks": 2, "profiler": "advanced"},
        {"chunks": 2, "profiler": "pytorch", "trainer": {"max_steps": 6, "val_check_interval": 2}},
    ]
    gpipe_job("mlp", 2, runs, steps=3, val=True)
    for kind in ("simple", "advanced"):
        for rank in (0, 1):
            report = (tmp_path / "profiles" / f"fit-{kind}-{rank}.txt").read_text()
            assert "GPipeStrategy.training_step" in report and "GPipeStrategy.backward" in report, (
                kind,
                rank,
            )
    for rank in (0, 1):
        report = (tmp_path / "profiles" / f"fit-pytorch-{rank}.txt").read_text()
        assert "[pl][profile]" in report and "training_step" in report, (rank, report[-2000:])


@pytest.mark.slow  # about 40 s: one 2-process job of four runs and their one-device references
@pytest.mark.timeout(400)
def test_pruning_lr_monitor_and_accumulation_scheduler_two_stages(gpipe_job, tmp_path):
    """2 stages, one job:
    - ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False), 2 epochs, made
      permanent: the pruned weights equal one device's (the callback listed every stage's layers in
      setup, before the cut);
      a checkpoint saved at the last epoch's end holds them under their plain names;
    - the same not made permanent, with the lottery ticket: weight_orig and weight_mask equal one device's;
    - LearningRateMonitor with ReduceLROnPlateau stepping on the last stage's loss: every rank logs
      one device's learning rates;
    - GradientAccumulationScheduler({0: 1, 1: 2}), 2 epochs: the parameters equal one device's.
    """
    epochs2 = {"max_epochs": 2, "max_steps": -1}
    prune = {"amount": 0.3, "use_global_unstructured": False}
    keep = {**prune, "make_pruning_permanent": False, "use_lottery_ticket_hypothesis": True}
    refs = [
        train_single_device(
            "mlp",
            0,
            steps=-1,
            val=True,
            trainer_extra=epochs2,
            callbacks=tuple(feature_callbacks({"pruning": kw})),
        )
        for kw in (prune, keep)
    ]
    lr_ref = train_single_device(
        "mlp",
        0,
        steps=5,
        plateau=True,
        return_trainer=True,
        trainer_extra={"logger": _recorder(), "log_every_n_steps": 1},
        callbacks=tuple(feature_callbacks({"lr_monitor": {"logging_interval": "step"}})),
    )[1]
    accumulation = {"scheduling": {"0": 1, "1": 2}}
    accumulated = train_single_device(
        "mlp",
        0,
        steps=-1,
        val=True,
        trainer_extra=epochs2,
        callbacks=tuple(feature_callbacks({"accumulation": accumulation})),
    )
    runs = [
        {"chunks": 2, "features": {"pruning": prune}, "trainer": epochs2},
        {"chunks": 2, "features": {"pruning": keep}, "trainer": epochs2},
        {
            "chunks": 2,
            "net": {"plateau": True},
            "record_logs": True,
            "trainer": {"log_every_n_steps": 1},
            "features": {"lr_monitor": {"logging_interval": "step"}},
        },
        {"chunks": 2, "features": {"accumulation": accumulation}, "trainer": epochs2},
    ]
    saving = {"checkpoint": {"save_last": True, "save_on_train_epoch_end": True}}
    on = {"enable_checkpointing": True}
    results, _ = gpipe_job(
        "mlp", 2, runs, steps=5, batch=10, val=True, callbacks=saving, trainer=on, timeout=360
    )
    for result, ref in zip(results[:2], refs):
        assert max_diff(result["state"], ref.state_dict()) <= 1e-5
    # the last epoch's checkpoint, pruning made permanent: every stage's weights under their plain names
    saved = torch.load(tmp_path / "ckpt0" / "last.ckpt", weights_only=False)["state_dict"]
    assert max_diff(saved, refs[0].state_dict()) <= 1e-5
    assert any(k.endswith("weight_mask") for k in results[1]["state"])
    expected_lrs = [m["lr-SGD"] for m in lr_ref.logger.logged if "lr-SGD" in m]
    assert len(expected_lrs) == 5 and len(set(expected_lrs)) > 1  # the plateau halved it
    for record in results[2]["ranks"]:
        assert [m["lr-SGD"] for m in record["logged"] if "lr-SGD" in m] == pytest.approx(expected_lrs)
    assert max_diff(results[3]["state"], accumulated.state_dict()) <= 1e-5
