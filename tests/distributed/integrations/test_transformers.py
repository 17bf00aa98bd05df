"""transformers models through lightning_gpipe.integrations.transformers: same outputs, shared
parameters, checkpoints map back, and pipelined training equal to one device (tied GPT-2 embedding
and head included).

Needs the ``[models]`` extra (transformers). Multi-process jobs run under hard timeouts (tests/_harness.py).
"""

import itertools
import json

import pytest
import torch

from lightning_gpipe.engine import microbatch
from lightning_gpipe.integrations.transformers import causal_lm, original_state_dict
from tests._harness import check, run_script
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
    check(run_script("tests/workers/hf_train.py", str(spec), timeout=600))
    return [
        [torch.load(tmp_path / f"run{k}_rank{r}.pt", weights_only=False) for r in range(stages)]
        for k in range(len(runs))
    ]


def _check_pipelined(tmp_path, stages):
    results = _run(tmp_path, stages, RUNS)
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
    within 1e-5."""
    _check_pipelined(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt2_and_llama_over_three_stages_train_like_one_device(tmp_path):
    """The same grid as over two stages, over three (the tied weight's copies on the first and last stage)."""
    _check_pipelined(tmp_path, 3)


IMAGE_RUNS = [
    {"family": "vit", "chunks": 4, "checkpoint": "except_last"},
    {"family": "resnet", "chunks": 1, "checkpoint": "always", "deferred_batch_norm": True},
    {"family": "resnet", "chunks": 4, "checkpoint": "except_last", "deferred_batch_norm": True, "steps": 1},
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
