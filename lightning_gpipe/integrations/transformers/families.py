"""The causal-LM families of the installed transformers that carry a pipeline plan."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def plan_families() -> list[tuple[str, str]]:
    """``(model_type, CausalLM class name)`` of every ``AutoModelForCausalLM`` family whose config
    class has a ``base_model_pp_plan``, encoder-decoders left out, sorted by model type."""
    out = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if model_type not in CONFIG_MAPPING:
            continue
        config_class = CONFIG_MAPPING[model_type]
        if getattr(config_class, "base_model_pp_plan", None) and not getattr(
            config_class, "is_encoder_decoder", False
        ):
            out.append((model_type, class_name))
    return out
