"""Hugging Face causal LMs as an ``nn.Sequential`` cut by their own pipeline plan."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_gpipe.integrations.transformers.plan import causal_lm_parts, sequential_of
from lightning_gpipe.integrations.transformers.self_check import check_family


def causal_lm(model: Any) -> nn.Sequential:
    """``[embeddings, layer 0, …, layer L-1, final norm, head]`` holding ``model``'s own submodules.

    The parts are those the model's pipeline plan names (``config.base_model_pp_plan``: the token
    embedding, the ``ModuleList`` of layers, the final norm; the CausalLM's ``_pp_plan``: the
    head), or a built-in plan for a popular family whose config has none (GPT-2, GPT-Neo, StableLM,
    Falcon, GPT-BigCode: :data:`~.plan.INFERRED_PLANS`). Between them the chain does
    the family's arithmetic read from the config: embedding multipliers, rotary tables (the base
    model's ``rotary_emb``, per layer type where it takes one), each layer's causal, sliding-window
    or chunked mask with the padding (``transformers.masking_utils``, per ``config.layer_types``),
    logit scaling and soft-capping. Before returning, a tiny random model of the same family checks
    the chain against its own ``forward``
    (:func:`~lightning_gpipe.integrations.transformers.self_check.check_family`).

    Args:
        model: a transformers ``*ForCausalLM`` (or ``GPT2LMHeadModel``), decoder-only.

    Returns:
        ``nn.Sequential`` of ``L + 3`` layers: ids ``(N, T)`` (int64), or ``{"input_ids": (N, T),
        "attention_mask": (N, T), "position_ids": (N, T)}`` (mask and positions optional; left or
        right padding; position ids restarting at 0 within a row pack several sequences) → logits
        ``(N, T, vocab)``, equal to ``model(...).logits`` with the same mask on real tokens.

    Raises:
        UnsupportedModelError: (a ``TypeError``) the family has no plan and no known layout, is an
            encoder-decoder, has layers without a mask here (linear attention, recurrent), or the
            chain differs from its ``forward`` on the tiny model; the message names the family,
            what is missing or differs, and the alternative.
    """
    parts = causal_lm_parts(model)
    check_family(model)
    return sequential_of(parts)
