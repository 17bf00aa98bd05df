"""A plan-cut causal LM built on the meta device: each stage materializes alone, with the model's own init."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_gpipe.balance import balance_by_memory, balance_by_parameters, balance_by_time  # noqa: E402
from lightning_gpipe.integrations.transformers import causal_lm  # noqa: E402
from lightning_gpipe.state.materialize import has_meta, initialize, materialize_layers  # noqa: E402

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=32,
)


def _meta(family: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(family, **TINY)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_meta_built_plan_model_materializes_stage_by_stage_as_its_own_init_for_any_stage_count(family):
    model = _meta(family)
    seq = causal_lm(model)  # [embeddings, layer 0, layer 1, norm, head]
    materialize_layers([(k, seq[k]) for k in (0, 1)], seed=3)  # stage 0 of 2
    assert [has_meta(layer) for layer in seq] == [False, False, True, True, True]
    materialize_layers([(k, seq[k]) for k in (2, 3, 4)], seed=3)  # stage 1 of 2
    assert not has_meta(model)
    # the same values as one stage (K = 1): the weights do not depend on the cut. Gemma 2 ties its
    # head to the embedding: one stage keeps them one tensor, the embedding's; over two, the last
    # stage's copy is its own until the strategy broadcasts the first stage's (partition.tied)
    whole = _meta(family)
    materialize_layers(list(enumerate(causal_lm(whole))), seed=3)
    tied = whole.config.tie_word_embeddings
    assert (whole.lm_head.weight is whole.model.embed_tokens.weight) == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is False
    for (name, tensor), (other, value) in zip(model.state_dict().items(), whole.state_dict().items()):
        assert name == other
        assert torch.equal(tensor, value) or (tied and name == "lm_head.weight"), name
    twin = _meta(family)
    initialize(causal_lm(twin), seed=3)  # the one-device twin: the same values, the same tie
    assert (twin.lm_head.weight is twin.model.embed_tokens.weight) == tied
    for name, value in whole.state_dict().items():
        assert torch.equal(twin.state_dict()[name], value), name
    # the model's own initialization: its eager twin's buffers (rotary tables, Gemma 2's embedding
    # scale) and norms (Llama: ones; Gemma 2: zeros), weights drawn with its initializer_range
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(model.config)
    own = dict(model.named_buffers())
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(own[name], buffer, rtol=0, atol=0, msg=name)
    params = dict(model.named_parameters())
    for name, param in eager.named_parameters():
        if "norm" in name:
            assert torch.equal(params[name], param), name
        elif param.dim() == 2:
            assert abs(float(params[name].std()) - model.config.initializer_range) < 0.004, name
    # and the chain of the materialized parts is the model's forward
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(seq(ids), model(ids).logits, rtol=0, atol=1e-5)


def test_every_balance_mode_takes_the_heavier_embedding_and_head_stages_into_account():
    # vocabulary 4096, width 32: the embedding and the head hold 131,072 parameters each, a layer 12,352
    config = transformers.AutoConfig.for_model(
        "llama", **{**TINY, "vocab_size": 4096, "num_hidden_layers": 8}
    )
    torch.manual_seed(0)
    seq = causal_lm(transformers.AutoModelForCausalLM.from_config(config))
    counts = [sum(p.numel() for p in layer.parameters()) for layer in seq]
    assert counts[0] == counts[-1] == 4096 * 32 and max(counts[1:-1]) < counts[0] / 8
    assert balance_by_parameters(seq, 3) == [1, 9, 1]  # the embedding and the head each alone
    ids = torch.randint(0, 4096, (4, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # an SFT batch as the sample
    for balance in (balance_by_time(seq, batch, 3, timeout=0.0), balance_by_memory(seq, batch, 3)):
        assert sum(balance) == len(seq) and len(balance) == 3
    # memory: the embedding's and the head's parameters (x 4 with Adam) outweigh 3 decoder layers
    assert balance_by_memory(seq, batch, 3)[0] < len(seq) // 3
