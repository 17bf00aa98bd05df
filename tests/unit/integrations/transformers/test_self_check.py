"""The construction-time check of causal_lm: a family whose forward does what the chain does not is
refused, naming the part that differs; shrunken configs keep every attention type.

Needs the ``[models]`` extra (transformers).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers comes with the [models] extra")

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaModel  # noqa: E402

from lightning_gpipe.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    causal_lm,
    shrink_config,
)

torch.set_num_threads(1)


class ScaledLogits(LlamaForCausalLM):
    """A family whose forward doubles the logits, which no config attribute says."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class ShiftedModel(LlamaModel):
    """A base model whose forward adds 1 to the embeddings."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        return super().forward(inputs_embeds=self.embed_tokens(input_ids) + 1, **kwargs)


class ShiftedEmbeddings(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = ShiftedModel(config)


def _config(**kw):
    return shrink_config(LlamaConfig(**kw))


@pytest.mark.parametrize(
    ("cls", "where"),
    [(ScaledLogits, "the logits differ"), (ShiftedEmbeddings, "the embeddings' output differs")],
)
def test_a_family_whose_forward_does_more_is_refused_naming_what_differs(cls, where):
    model = cls(_config())
    with pytest.raises(UnsupportedModelError, match=f"cannot reproduce llama \\({cls.__name__}\\)") as error:
        causal_lm(model)
    assert f"{where} from {cls.__name__}.forward by" in str(error.value)


def test_a_large_model_is_checked_on_a_tiny_one_of_its_family():
    """A 6-layer, width-64 Llama, built on the meta device, is checked on a 2-layer, width-32 one on
    the CPU; its own parameters are held."""
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    seq = causal_lm(model)
    assert len(seq) == 6 + 3
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}


def test_shrink_config_keeps_one_layer_per_attention_type_and_short_windows():
    config = shrink_config(
        MistralConfig(
            num_hidden_layers=12,
            sliding_window=4096,
            layer_types=["sliding_attention"] * 11 + ["full_attention"],
        )
    )
    assert config.num_hidden_layers == 2 and config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window == 3 and config.hidden_size == 32 and config.vocab_size == 101
