"""Lightning features keep their one-device values under the gpipe strategy (CPU, Gloo, hard timeouts)."""

import math

import pytest
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DistributedSampler

from tests.conftest import max_diff
from tests.models import Net, make_data, train_single_device


@pytest.mark.timeout(300)
def test_pipeline_times_data_parallel_matches_single_device(gpipe_job):
    """P=2 stages × D=2 replicas, 5 samples per replica = one device on the 10-sample concatenated batch.

    As under DDP, Lightning's DistributedSampler shards and shuffles the training data, seeded by the
    global seed and the epoch, the same on every rank: over two epochs each replica's stages draw
    exactly the shard DDP's replica draws (computed here independently), and the one-device
    reference trains on the concatenation of what the replicas saw. The mesh is given three ways (K
    alone, D alone, all three sizes): every rank's ``self.device_mesh`` is the same 2 × 2 × 1 mesh,
    placed as the layout's formula says (issue 42); and so with the stages sharded over the replicas
    (``data_parallel="fsdp"``).
    """
    mesh = {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 1}
    results, _ = gpipe_job(
        "mlp",
        4,
        [
            {"chunks": 2, "pipeline_parallel_size": 2},
            {"chunks": 2, "data_parallel_size": 2, "schedule": "1f1b"},
            {"chunks": 2, **mesh, "data_parallel": "replicate", "schedule": "zb_h1", "checkpoint": "never"},
            {"chunks": 2, **mesh, "data_parallel": "fsdp", "schedule": "1f1b"},  # sharded stages (issue 42)
        ],
        steps=-1,
        batch=5,
        samples=30,
        trainer={"max_epochs": 2, "max_steps": -1},
        net={"indexed": True, "sync_dist": True},
    )
    for r, calls in zip(
        results, (1, 2, 2, 2)
    ):  # schedule="1f1b" and "zb_h1": training_step once per micro-batch (3 + 2 samples)
        ranks = r["ranks"]  # replica 0: ranks 0 (last stage), 1 (first); replica 1: ranks 2, 3
        seen = [[sum(rank["indices"][s * calls : (s + 1) * calls], []) for s in range(6)] for rank in ranks]
        for replica, (a, b) in enumerate([(0, 1), (2, 3)]):
            assert seen[a] == seen[b]  # every stage of a replica: the same batches
            expected = []
            for epoch in range(2):  # DDP's shard of this replica, seed 0 (the worker's seed_everything)
                sampler = DistributedSampler(range(30), num_replicas=2, rank=replica, shuffle=True, seed=0)
                sampler.set_epoch(epoch)
                shard = list(sampler)
                expected += [shard[k : k + 5] for k in range(0, 15, 5)]
            assert seen[a] == expected
        order = [a + b for a, b in zip(seen[0], seen[2])]
        assert len(order) == 6
        reference = train_single_device("mlp", 0, steps=6, batch=10, data={"order": order, "samples": 30})
        assert max(abs(a - b) for a, b in zip(r["synced_losses"], reference.losses)) <= 1e-5
        assert max_diff(r["state"], reference.state_dict()) <= 1e-5
        check_mesh([rank["mesh"] for rank in ranks], stages=2, replicas=2)


def check_mesh(meshes: list[dict], stages: int, replicas: int) -> None:
    """Each rank's recorded ``device_mesh`` (tests/workers/train.py ``mesh_record``): named dimensions
    of sizes (K, D, 1); stage s of replica d on rank d·K + (K-1-s), its coordinate along the pipeline
    K-1-s; every dimension's group the ranks that differ from it only there, a data-parallel group
    holding one stage."""
    k = stages
    stage_of = {rank: m["stage"] for rank, m in enumerate(meshes)}
    for rank, m in enumerate(meshes):
        d, s = rank // k, stage_of[rank]
        assert rank == d * k + (k - 1 - s)
        assert m["names"] == ("pipeline_parallel", "data_parallel", "tensor_parallel")
        assert m["shape"] == (k, replicas, 1) and m["is_strategy_mesh"]
        assert list(m["coordinate"]) == [k - 1 - s, d, 0]
        assert m["local_rank"] == dict(zip(m["names"], m["coordinate"]))
        pipeline = list(range(d * k, (d + 1) * k))
        data = [e * k + (k - 1 - s) for e in range(replicas)]
        groups = {"pipeline_parallel": pipeline, "data_parallel": data, "tensor_parallel": [rank]}
        assert m["group_ranks"] == groups and m["slice"] == groups
        assert {stage_of[r] for r in m["group_ranks"]["data_parallel"]} == {s}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(  # lightning.pytorch in the default suite: test_transparency
    "namespace", ["pytorch_lightning", pytest.param("lightning.pytorch", marks=pytest.mark.slow)]
)
def test_checkpoint_and_early_stopping_agree_on_every_rank(gpipe_job, tmp_path, namespace):
    """val_loss is logged only on the last stage; every rank stops at the same epoch as one device
    (``pytorch_lightning`` and ``import lightning as L``: Trainer, module and callbacks of that namespace)."""
    es = {"monitor": "val_loss", "patience": 1, "mode": "max"}  # val_loss falls: stops after 2 epochs
    mc = {"monitor": "val_loss", "save_top_k": 1}
    extra = {"max_epochs": 6, "max_steps": -1, "enable_checkpointing": True}
    reference, ref_trainer = train_single_device(
        "mlp",
        0,
        steps=5,
        val=True,
        trainer_extra=extra,
        return_trainer=True,
        callbacks=(ModelCheckpoint(dirpath=tmp_path / "ref", **mc), EarlyStopping(**es)),
    )
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 2}],
        steps=5,
        val=True,
        trainer=extra,
        callbacks={"checkpoint": mc, "early_stopping": es},
        namespace=namespace,
    )
    ranks = results[0]["ranks"]
    assert {r["strategy_class"].split(".")[0] for r in ranks} == {namespace.split(".")[0]}
    assert {r["current_epoch"] for r in ranks} == {ref_trainer.current_epoch}
    assert ranks[0]["best_model_path"] == ranks[1]["best_model_path"]
    assert ranks[0]["best_model_path"].endswith(
        ref_trainer.checkpoint_callback.best_model_path.split("/")[-1]
    )
    for r in ranks:  # every rank sees the last stage's values
        assert r["callback_metrics"]["val_loss"] == pytest.approx(
            ref_trainer.callback_metrics["val_loss"].item(), abs=1e-5
        )
    best = torch.load(ranks[0]["best_model_path"], weights_only=False)
    plain = Net("mlp")
    plain.load_state_dict(best["state_dict"], strict=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("norm_type", [2.0, pytest.param(math.inf, marks=pytest.mark.slow)])  # inf: slow set
def test_gradient_clipping_uses_the_global_norm(gpipe_job, norm_type):
    """Clip 0.1 by the 2- or inf-norm over all three stages: same clipped gradients and total norm
    as one device."""
    reference = train_single_device(
        "mlp", 0, steps=3, trainer_extra={"gradient_clip_val": 0.1}, ref_clip_norm_type=norm_type
    )
    results, _ = gpipe_job(
        "mlp",
        3,
        [
            {"chunks": 3, "gradient_clip_norm_type": norm_type},
            {"chunks": 3, "gradient_clip_norm_type": norm_type, "schedule": "1f1b"},
            {"chunks": 3, "gradient_clip_norm_type": norm_type, "schedule": "zb_h1", "checkpoint": "never"},
        ],
        steps=3,
        trainer={"gradient_clip_val": 0.1},
    )
    for result in results:  # fill-drain, 1F1B, ZB-H1
        for record in result["ranks"]:
            assert record["norms"] == pytest.approx(reference.norms, rel=1e-5)
            for ours, ref in zip(record["clipped"], reference.clipped):
                assert max_diff(ours, {k: ref[k] for k in ours}) <= 1e-6
        assert max_diff(result["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(300)
def test_stage_without_parameters_and_frozen_stage_train_like_one_device(gpipe_job):
    """Stages [Linear] (frozen), [ReLU], [Linear]: two stages have no gradients; clipping does not hang;
    under ZB-H1 too (a stage whose backward has no weights to split)."""
    extra = {"gradient_clip_val": 0.1}
    reference = train_single_device("lrl", 0, steps=3, trainer_extra=extra, freeze_first=True)
    runs = [{"chunks": 2}, {"chunks": 2, "schedule": "zb_h1", "checkpoint": "never"}]
    results, _ = gpipe_job("lrl", 3, runs, steps=3, trainer=extra, net={"freeze_first": True})
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference.losses)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(results[1]["synced_losses"], reference.losses)) <= 1e-5
    for result in results:
        assert max_diff(result["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(300)
def test_checkpoint_loads_into_plain_module_and_resume_matches_one_device(gpipe_job, tmp_path):
    """Save after 2 steps with 2 stages; resume to step 5 equals the same resume on one device."""
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 3}],
        steps=2,
        save="two.ckpt",
        resume={"ckpt": str(tmp_path / "two.ckpt"), "steps": 5},
        trainer={"max_epochs": 3},
    )
    ckpt = torch.load(tmp_path / "two.ckpt", weights_only=False)
    Net("mlp").load_state_dict(ckpt["state_dict"], strict=True)
    # the same on one device
    _, trainer = train_single_device("mlp", 0, steps=2, return_trainer=True, trainer_extra={"max_epochs": 3})
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    one = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert max_diff(ckpt["state_dict"], one["state_dict"]) <= 1e-5
    assert (
        ckpt["optimizer_states"][0]["param_groups"][0]["params"]
        == one["optimizer_states"][0]["param_groups"][0]["params"]
    )
    resumed = train_single_device(
        "mlp", 0, steps=5, ckpt_path=str(tmp_path / "one.ckpt"), trainer_extra={"max_epochs": 3}
    )
    assert len(resumed.losses) == 3
    assert max(abs(a - b) for a, b in zip(results[0]["resumed_losses"], resumed.losses)) <= 1e-5
    assert max_diff(results[0]["state"], resumed.state_dict()) <= 1e-5
    # the pipeline's checkpoint is a standard one: the plain one-device Trainer resumes from it too
    cross = train_single_device(
        "mlp", 0, steps=5, ckpt_path=str(tmp_path / "two.ckpt"), trainer_extra={"max_epochs": 3}
    )
    assert max_diff(cross.state_dict(), resumed.state_dict()) <= 1e-5


@pytest.mark.timeout(300)
def test_sync_dist_logging_and_torchmetrics_match_one_device(gpipe_job):
    """P=2 × D=2: val_loss (sync_dist=True) and a torchmetrics accuracy equal the one-device values.

    Validation data are not shuffled, so the replicas' halves make up the one-device batches; the
    learning rate is 0 so that the (shuffled) training batches do not matter.
    """
    _, ref_trainer = train_single_device("cls", 0, steps=5, lr=0.0, val=True, return_trainer=True)
    results, _ = gpipe_job(
        "cls",
        4,
        [{"chunks": 2, "pipeline_parallel_size": 2}],
        steps=5,
        lr=0.0,
        batch=5,
        samples=50,
        val=True,
        val_samples=20,
        net={"sync_dist": True},
    )
    expected = {k: ref_trainer.callback_metrics[k].item() for k in ("val_loss", "val_acc")}
    for record in results[0]["ranks"]:
        for key, value in expected.items():
            assert record["callback_metrics"][key] == pytest.approx(value, abs=1e-5), key


@pytest.mark.timeout(300)
def test_bf16_mixed_on_cpu_trains_close_to_one_device(gpipe_job):
    extra = {"precision": "bf16-mixed"}
    reference = train_single_device("mlp", 0, steps=5, trainer_extra=extra)
    results, _ = gpipe_job(
        "mlp",
        2,
        [
            {"chunks": 2},
            {"chunks": 2, "schedule": "1f1b"},
            {"chunks": 2, "schedule": "zb_h1", "checkpoint": "never"},
        ],
        steps=5,
        trainer=extra,
    )
    assert len(results[0]["losses"]) == 5
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference.losses)) <= 2e-2
    for result in results[1:]:  # 1F1B, ZB-H1: the logged loss, combined over the micro-batch calls
        logged = result["synced_losses"]
        assert len(logged) == 5 and max(abs(a - b) for a, b in zip(logged, reference.losses)) <= 2e-2


# about 20 s; test_callbacks.py checks predictions on every rank against one device in the default suite
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_predict_returns_last_stage_outputs_in_order(gpipe_job):
    reference, trainer = train_single_device("mlp", 0, steps=3, return_trainer=True)
    expected = trainer.predict(reference, make_data("mlp", 10, 2, seed=2))
    results, _ = gpipe_job("mlp", 3, [{"chunks": 4}], steps=3, predict=True)
    preds = results[0]["predictions"]
    assert len(preds) == len(expected)
    for ours, ref in zip(preds, expected):
        assert torch.allclose(ours, ref, atol=1e-5)
    for ours, ref in zip(
        results[0]["ranks"][1]["predictions"], expected
    ):  # every rank holds them, as under DDP
        assert torch.allclose(ours, ref, atol=1e-5)


# about 35 s: three processes then two; tests/unit/state/test_sharded.py covers the sharded
# format in the default suite
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sharded_checkpoint_saved_by_3_stages_resumes_on_2(gpipe_job, tmp_path):
    """checkpoint_format="sharded": each of 3 stages writes its shard; 2 stages resume and match one
    device."""
    path = tmp_path / "sharded"
    saved, _ = gpipe_job(
        "mlp",
        3,
        [{"chunks": 2, "checkpoint_format": "sharded"}],
        steps=2,
        save_at_train_end="sharded",
        atomic_check=True,
        trainer={"max_epochs": 3},
    )
    assert {r.get("atomic_error") for r in saved[0]["ranks"]} != {None}, "the second save was meant to fail"
    meta = torch.load(path / "lightning_meta.pt", weights_only=False)  # intact after the failing re-save
    assert meta["global_step"] == 2 and "bad" not in meta
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 3, "checkpoint_format": "sharded"}],
        steps=2,
        fit=False,
        resume={"ckpt": str(path), "steps": 5},
        trainer={"max_epochs": 3},
    )
    _, trainer = train_single_device("mlp", 0, steps=2, return_trainer=True, trainer_extra={"max_epochs": 3})
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    resumed = train_single_device(
        "mlp", 0, steps=5, ckpt_path=str(tmp_path / "one.ckpt"), trainer_extra={"max_epochs": 3}
    )
    assert max(abs(a - b) for a, b in zip(results[0]["resumed_losses"], resumed.losses)) <= 1e-5
    assert max_diff(results[0]["state"], resumed.state_dict()) <= 1e-5


@pytest.mark.timeout(300)
def test_accumulation_scheduler_and_loop_limits_match_one_device(gpipe_job):
    """accumulate_grad_batches=2, a StepLR stepping every epoch, validation twice per epoch on one
    batch, one sanity-check batch: same losses, validation values, learning rates and parameters."""
    extra = {
        "max_epochs": 2,
        "max_steps": -1,
        "accumulate_grad_batches": 2,
        "val_check_interval": 0.5,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 1,
    }
    reference, ref_trainer = train_single_device(
        "mlp", 0, steps=5, val=True, trainer_extra=extra, return_trainer=True, scheduler=True
    )
    results, _ = gpipe_job(
        "mlp",
        2,
        [{"chunks": 3}, {"chunks": 3, "schedule": "1f1b"}],
        steps=5,
        val=True,
        trainer=extra,
        net={"scheduler": True},
    )
    r = results[0]
    assert r["global_step"] == ref_trainer.global_step == 6  # 5 batches per epoch, 2 epochs, 2 per step
    assert len(r["losses"]) == len(reference.losses) == 10
    assert max(abs(a - b) for a, b in zip(r["losses"], reference.losses)) <= 1e-5
    for r in results:  # schedule="1f1b" too: training_step once per micro-batch, loss divided by 2
        assert r["global_step"] == 6 and len(r["synced_losses"]) == 10
        assert max(abs(a - b) for a, b in zip(r["synced_losses"], reference.losses)) <= 1e-5
        assert r["lrs"] == pytest.approx(reference.lrs) == [0.05, 0.025]
        assert r["callback_metrics"]["val_loss"] == pytest.approx(
            ref_trainer.callback_metrics["val_loss"].item(), abs=1e-5
        )
        assert max_diff(r["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(120)
def test_several_optimizers_fail_with_a_clear_error(tmp_path):
    import json

    from tests._harness import run_failing, traceback_ends

    spec = {"kind": "mlp", "devices": 2, "runs": [{}], "out": str(tmp_path), "net": {"two_optimizers": True}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = run_failing("tests/workers/train.py", 2, str(tmp_path / "spec.json"), timeout=100)
    said = "ValueError: configure_optimizers returned 2 optimizers (on stage "
    assert said in out and "supports a single optimizer" in out, out[-3000:]
    # every rank the same error, none torch's or Lightning's own
    assert "[lightning_gpipe] stage 0 (rank 1) failed: " + said in out, out[-3000:]
    assert "[lightning_gpipe] stage 1 (rank 0) failed: " + said in out, out[-3000:]
    # each rank's traceback once (its report: 2 in all); where the error ends its process, one line naming it
    ends = traceback_ends(out)
    assert sum(end.startswith(said) for end in ends) == 2, ends
    for stage, rank in ((0, 1), (1, 0)):
        assert f"[lightning_gpipe] stage {stage} (rank {rank}) exits on the ValueError reported above" in out


# about 20 s; clipping by value is elementwise within a stage, and the clipping hook runs in the
# default suite's global-norm test
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradient_clipping_by_value_matches_one_device(gpipe_job):
    extra = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}
    reference = train_single_device("mlp", 0, steps=3, trainer_extra=extra)
    results, _ = gpipe_job("mlp", 2, [{"chunks": 2}], steps=3, trainer=extra)
    for record in results[0]["ranks"]:
        for ours, ref in zip(record["clipped"], reference.clipped):
            assert max_diff(ours, {k: ref[k] for k in ours}) <= 1e-6
            assert all(g.abs().max() <= 0.05 + 1e-7 for g in ours.values())
    assert max_diff(results[0]["state"], reference.state_dict()) <= 1e-5


@pytest.mark.slow  # about 20 s; the plain-module resume test covers resuming in the default suite
@pytest.mark.timeout(300)
def test_resume_at_epoch_boundary_equals_uninterrupted_run(gpipe_job, tmp_path):
    """Save after epoch 1 (5 steps, 3 stages), resume for epoch 2: the same as 2 uninterrupted
    epochs on one device."""
    results, _ = gpipe_job(
        "mlp",
        3,
        [{"chunks": 2}],
        steps=-1,
        save="epoch1.ckpt",
        trainer={"max_epochs": 1},
        resume={"ckpt": str(tmp_path / "epoch1.ckpt"), "steps": -1, "trainer": {"max_epochs": 2}},
    )
    uninterrupted = train_single_device(
        "mlp", 0, steps=-1, trainer_extra={"max_epochs": 2}, data={"samples": 50}
    )
    assert len(uninterrupted.losses) == 10 and len(results[0]["resumed_losses"]) == 5
    assert max(abs(a - b) for a, b in zip(results[0]["resumed_losses"], uninterrupted.losses[5:])) <= 1e-5
    assert max_diff(results[0]["state"], uninterrupted.state_dict()) <= 1e-5
