"""The causal-LM families of the installed transformers that carry a pipeline plan, or have a built-in one."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_gpipe.integrations.transformers.plan import INFERRED_PLANS


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


def builtin_plan_families() -> list[tuple[str, str]]:
    """``(model_type, CausalLM class name)`` of the families without a ``base_model_pp_plan`` that
    :func:`~lightning_gpipe.integrations.transformers.causal_lm` cuts by a built-in plan (GPT-2, GPT-Neo,
    StableLM, Falcon, GPT-BigCode), those the installed transformers has, sorted by model type."""
    plans = {t for t, _ in plan_families()}
    return [
        (t, c)
        for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
        if t in INFERRED_PLANS and t not in plans
    ]
