"""transformers models through lightning_gpipe.integrations.transformers: same outputs, shared parameters, checkpoints map back,
and pipelined training equal to one device (tied GPT-2 embedding and head included).

Needs the ``[models]`` extra (transformers). Multi-process jobs run under hard timeouts (tests/_harness.py).
"""

import itertools
import json

import pytest
import torch

from lightning_gpipe.integrations.transformers import causal_lm, image_classifier, original_state_dict
from tests._harness import check, run_script
from tests.hf_models import (  # noqa: E402
    HFCausalLM,
    build_hf,
    lm_data,
    lm_loss_reference,
    reference,
)

transformers = pytest.importorskip("transformers", reason="transformers comes with the [models] extra")


torch.set_num_threads(1)


def _image_models():
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    resnet = ResNetForImageClassification(
        ResNetConfig(num_labels=10, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    )
    vit = ViTForImageClassification(
        ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip
    return [(resnet, torch.randn(2, 3, 32, 32)), (vit, torch.randn(2, 3, 16, 16))]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_shares_parameters_and_computes_the_model_logits(family):
    model = build_hf(family).eval()
    seq = causal_lm(model)
    assert len(seq) == 2 + 3  # embeddings, 2 blocks, final norm, head
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}  # shared, not copied
    ids = next(iter(lm_data()))[0]
    with torch.no_grad():
        torch.testing.assert_close(seq(ids), model(ids).logits, rtol=0, atol=1e-6)
        assert model(ids, labels=ids).loss.item() == pytest.approx(
            lm_loss_reference(seq(ids), ids).item(), abs=1e-6
        )
    if family == "gpt2":
        assert seq[-1].weight is seq[0].wte.weight  # the head stays tied


@pytest.mark.parametrize("index", [0, 1], ids=["resnet", "vit"])
def test_image_classifier_shares_parameters_and_computes_the_model_logits(index):
    model, x = _image_models()[index]
    model.eval()
    seq = image_classifier(model)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    with torch.no_grad():
        torch.testing.assert_close(seq(x), model(x).logits, rtol=0, atol=1e-6)


def test_original_state_dict_loads_strictly_into_a_fresh_model():
    trained = HFCausalLM("gpt2")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    saved = {f"layers.{k}": v for k, v in trained.layers.state_dict().items()}  # as a checkpoint holds it
    fresh = build_hf("gpt2")
    fresh.load_state_dict(original_state_dict(fresh, causal_lm(fresh), saved, prefix="layers."), strict=True)
    torch.testing.assert_close(fresh.transformer.wte.weight, trained.hf.transformer.wte.weight)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    with pytest.raises(KeyError, match="missing from the state_dict"):
        original_state_dict(fresh, causal_lm(fresh), {}, prefix="layers.")
    with pytest.raises(TypeError, match="causal_lm supports GPT-2"):
        causal_lm(torch.nn.Linear(2, 2))


RUNS = [  # the full grid, 8 runs in one multi-process job per stage count
    {"family": family, "chunks": chunks, "checkpoint": checkpoint}
    for family, chunks, checkpoint in itertools.product(("gpt2", "llama"), (1, 4), ("except_last", "always"))
]


TIED = ("layers.0.wte.weight", "layers.4.weight")


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
    references = {family: reference(family) for family in ("gpt2", "llama")}
    for k, (run, ranks) in enumerate(zip(RUNS, results)):
        ref = references[run["family"]]
        loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref.losses))
        assert len(ranks[0]["losses"]) == 5 and loss_diff <= 1e-5, (
            f"K={stages} {run}: losses differ by {loss_diff}"
        )
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
    """Tiny GPT-2 (tied) and Llama × chunks {1, 4} × checkpoint {except_last, always}: 5 SGD steps within 1e-5."""
    _check_pipelined(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt2_and_llama_over_three_stages_train_like_one_device(tmp_path):
    """The same grid as over two stages, over three (the tied weight's copies on the first and last stage)."""
    _check_pipelined(tmp_path, 3)
