"""transformers models through lightning_gpipe.integrations.transformers: same outputs, shared
parameters, checkpoints map back, and pipelined training equal to one device (tied GPT-2 embedding
and head included).

Needs the ``[models]`` extra (transformers). Multi-process jobs run under hard timeouts (tests/_harness.py).
"""

import itertools

import pytest
import torch

from lightning_gpipe.integrations.transformers import causal_lm, image_classifier, original_state_dict
from tests.hf_models import (  # noqa: E402
    HFCausalLM,
    build_hf,
    lm_data,
    lm_loss_reference,
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
        assert seq[-1].lm_head.weight is seq[0].wte.weight  # the head stays tied


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
    with pytest.raises(TypeError, match="causal_lm takes a transformers causal LM"):
        causal_lm(torch.nn.Linear(2, 2))


RUNS = [  # the full grid, 8 runs in one multi-process job per stage count
    {"family": family, "chunks": chunks, "checkpoint": checkpoint}
    for family, chunks, checkpoint in itertools.product(("gpt2", "llama"), (1, 4), ("except_last", "always"))
]
