"""transformers models through lightning_gpipe.integrations.transformers: same outputs, shared
parameters, checkpoints map back, and pipelined training equal to one device (tied GPT-2 embedding
and head included). The two-stage job also trains the nanoGPT-style ``ModuleList`` model of
:mod:`tests.gpt` by ``plan=`` (lightning_gpipe.partition.plan): equal to one device under gpipe and 1f1b,
its full and sharded checkpoints under the class's own keys, a one-device checkpoint loaded.

Needs the ``[models]`` extra (transformers). Multi-process jobs run under hard timeouts (tests/_harness.py).
"""

import itertools
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils

from lightning_gpipe.engine import microbatch
from lightning_gpipe.integrations.transformers import causal_lm, original_state_dict
from tests._harness import check, run_ranks
from tests.gpt import GPT, PLAN
from tests.hf_models import (  # noqa: E402
    build_hf,
    micro_batch_reference,
    reference,
)

torch.set_num_threads(1)


RUNS = [  # the full grid, 8 runs in one multi-process job per stage count
    {"family": family, "chunks": chunks, "checkpoint": checkpoint}
    for family, chunks, checkpoint in itertools.product(("gpt2", "llama"), (1, 4), ("except_last", "always"))
] + [  # padded SFT batches (mixed lengths, left and right padding; Mistral: a window of 3)
    {"family": family, "chunks": 4, "schedule": schedule, "steps": 4}
    for family, schedule in itertools.product(("llama-sft", "mistral-sft"), ("gpipe", "1f1b"))
]


TIED = ("layers.0.wte.weight", "layers.4.lm_head.weight")


def _run(tmp_path, stages, runs):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"devices": stages, "out": str(tmp_path), "runs": runs}))
    for result in run_ranks("tests/workers/hf_train.py", stages, str(spec), timeout=600):  # torchrun-style
        check(result)
    return [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(stages)]
        for k in range(len(runs))
    ]


def _plan_runs(tmp_path):
    """gpipe with a full checkpoint, 1f1b with a sharded one, and a fit from the one-device model's
    checkpoint (written here; its 4 steps are done, so the fit only loads it and gathers it back)."""
    ref, trainer = reference("nanogpt", steps=4, trainer=True)
    trainer.save_checkpoint(tmp_path / "one_device.ckpt")
    base = {"family": "nanogpt", "plan": PLAN, "chunks": 4, "steps": 4}
    return ref, [
        base,
        {**base, "schedule": "1f1b", "checkpoint_format": "sharded"},
        {**base, "ckpt_path": str(tmp_path / "one_device.ckpt")},
    ]


def _check_plan(tmp_path, ref, results, first):
    """The plan runs (``first``: the first one's index): losses and weights within 1e-5 of one device, under
    the class's keys; the full and the sharded checkpoint load into the class with strict=True."""
    keys, ref_state = list(GPT().state_dict()), ref.state_dict()
    for k, ranks in enumerate(results, first):
        losses, state = ranks[0]["losses"], ranks[0]["state"]
        if k == first + 2:  # loaded from one device's checkpoint after its last step: nothing left to train
            assert losses == []
        else:
            if k == first + 1:  # 1f1b: one training_step per micro-batch (4 of 2 samples each)
                losses = [sum(losses[i : i + 4]) / 4 for i in range(0, 16, 4)]
            assert len(losses) == 4 and max(abs(a - b) for a, b in zip(losses, ref.losses)) <= 1e-5, k
        assert list(state) == keys
        for name, value in state.items():
            assert (value - ref_state[name]).abs().max() <= 1e-5, f"plan run {k}: {name} differs"
    full = torch.load(tmp_path / f"run{first}.ckpt", weights_only=False)
    assert list(full["state_dict"]) == keys
    assert full["optimizer_states"][0]["gpipe_param_names"] == [n for n, _ in GPT().named_parameters()]
    sharded = tmp_path / f"run{first + 1}.ckpt"
    saved = {
        k.removeprefix("model.") for k in dcp.FileSystemReader(sharded).read_metadata().state_dict_metadata
    }
    assert set(keys) <= saved and not {k for k in saved if k.startswith(tuple(PLAN))} - set(keys)
    format_utils.dcp_to_torch_save(sharded, tmp_path / "sharded.pt")
    for state in (full["state_dict"], torch.load(tmp_path / "sharded.pt", weights_only=False)["model"]):
        model = GPT()
        model.load_state_dict(state, strict=True)
        torch.testing.assert_close(model.state_dict(), ref_state, rtol=0, atol=1e-5)
        assert model.head.weight is model.embed.tok.weight


def _check_pipelined(tmp_path, stages):
    ref, plan_runs = _plan_runs(tmp_path) if stages == 2 else (None, [])
    results = _run(tmp_path, stages, RUNS + plan_runs)
    if plan_runs:
        _check_plan(tmp_path, ref, results[len(RUNS) :], len(RUNS))
        results = results[: len(RUNS)]
    references = {
        (run["family"], run.get("steps", 5)): reference(run["family"], run.get("steps", 5)) for run in RUNS
    }
    for k, (run, ranks) in enumerate(zip(RUNS, results)):
        steps = run.get("steps", 5)
        ref = references[run["family"], steps]
        losses = ranks[0]["losses"]  # one per training_step call: per micro-batch under 1f1b
        assert len(losses) == steps * (4 if run.get("schedule") == "1f1b" else 1), (
            f"{run}: {len(losses)} losses"
        )
        if run.get("schedule") != "1f1b":
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref.losses))
            assert loss_diff <= 1e-5, f"K={stages} {run}: losses differ by {loss_diff}"
        ref_state = ref.state_dict()
        for name, value in ranks[0]["state"].items():
            assert (value - ref_state[name]).abs().max() <= 1e-5, f"K={stages} {run}: {name} differs"
        if run["family"] == "gpt2":  # the first stage (highest rank) and the last (rank 0) hold a copy each
            for first, last in zip(ranks[-1]["params"], ranks[0]["params"], strict=True):
                assert torch.equal(first[TIED[0]], last[TIED[1]])
        saved = torch.load(tmp_path / f"run{k}.ckpt", weights_only=False)["state_dict"]
        fresh = build_hf(run["family"])
        fresh.load_state_dict(
            original_state_dict(fresh, causal_lm(fresh), saved, prefix="layers."), strict=True
        )
        torch.testing.assert_close(causal_lm(fresh).state_dict(), ref.layers.state_dict(), rtol=0, atol=1e-5)


@pytest.mark.timeout(900)
def test_gpt2_and_llama_over_two_stages_train_like_one_device(tmp_path):
    """Tiny GPT-2 (tied) and Llama × chunks {1, 4} × checkpoint {except_last, always}: 5 SGD steps
    within 1e-5; in the same job, the nanoGPT-style model by ``plan=`` (:func:`_check_plan`)."""
    _check_pipelined(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt2_and_llama_over_three_stages_train_like_one_device(tmp_path):
    """The same grid as over two stages, over three (the tied weight's copies on the first and last stage)."""
    _check_pipelined(tmp_path, 3)


IMAGE_RUNS = [
    {"family": "vit", "chunks": 4, "checkpoint": "except_last"},
    {"family": "resnet", "chunks": 1, "checkpoint": "always", "deferred_batch_norm": True},
    {
        "family": "resnet",
        "chunks": 4,
        "checkpoint": "except_last",
        "batch_norm": "micro_batch",
        "deferred_batch_norm": True,
        "steps": 1,
    },
]


FIRST_BN = "layers.0.embedder.normalization."


@pytest.mark.slow  # about 25 s; GPT-2 and Llama over two stages stay in the default suite
@pytest.mark.timeout(900)
def test_resnet_and_vit_over_two_stages_train_like_one_device(tmp_path):
    """ViT (LayerNorm) with 4 micro-batches, and ResNet (BatchNorm) with 1, equal one device within 1e-5 after
    5 steps.

    ResNet with 4 micro-batches (sizes 3, 3, 2, 2) and deferred BatchNorm, one step: each BatchNorm normalises
    each micro-batch by that micro-batch's statistics in the forward, as GPipe does, so the result is not the
    full batch's. It equals, within 1e-5 (measured about 1e-7: float32 summation order), for every parameter
    and every BatchNorm's running statistics, the same step written out on one device without the library
    (``tests.hf_models.micro_batch_reference``): micro-batches as ``torch.tensor_split`` makes them (the
    pipeline's own split, ``lightning_gpipe.engine.microbatch.sizes``), losses weighted by n_i / N, gradients
    accumulated, one SGD step, and each BatchNorm's running statistics updated once from the inputs
    it received over all micro-batches (what a deferred BatchNorm accumulates and commits). Only for
    the first BatchNorm are those inputs the full batch's (the embedder's convolution runs per
    sample), so its running statistics also equal those of one device on the full batch; later
    BatchNorms see activations normalised per micro-batch upstream, and their running statistics
    differ from the full-batch ones (by about 5e-3 here).
    """
    results = _run(tmp_path, 2, IMAGE_RUNS)
    for run, ranks in zip(IMAGE_RUNS[:2], results[:2]):
        ref = reference(run["family"])
        loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref.losses))
        assert len(ranks[0]["losses"]) == 5 and loss_diff <= 1e-5, f"{run}: losses differ by {loss_diff}"
        ref_state = ref.state_dict()
        for name, value in ranks[0]["state"].items():
            assert (value.double() - ref_state[name].double()).abs().max() <= 1e-5, f"{run}: {name} differs"
    full, state = reference("resnet", steps=1).state_dict(), results[2][0]["state"]
    for stat in ("running_mean", "running_var"):
        torch.testing.assert_close(state[FIRST_BN + stat], full[FIRST_BN + stat], rtol=0, atol=1e-5)
    assert state[FIRST_BN + "num_batches_tracked"] == full[FIRST_BN + "num_batches_tracked"] == 1
    micro, micro_sizes = micro_batch_reference("resnet", IMAGE_RUNS[2]["chunks"])
    assert micro_sizes == microbatch.sizes(10, IMAGE_RUNS[2]["chunks"]) == [3, 3, 2, 2]
    expected = micro.state_dict()
    assert state.keys() == expected.keys()
    assert sum(k.endswith("running_var") for k in expected) == 6  # every BatchNorm, not only the first
    for name, value in expected.items():
        diff = (state[name].double() - value.double()).abs().max().item()
        assert diff <= 1e-5, f"{name}: pipelined and the one-device micro-batch step differ by {diff}"
    later = max((expected[k] - full[k]).abs().max().item() for k in expected if k.endswith("running_var"))
    assert later > 1e-3, f"the micro-batch effect on the later running statistics is only {later}"
