"""The parts of a causal LM that :func:`~lightning_gpipe.integrations.transformers.causal_lm`
chains, and its family's arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class CausalLMParts:
    """A decoder-only causal LM named by its pipeline plan (``config.base_model_pp_plan`` and the
    CausalLM class's ``_pp_plan``), with the arithmetic its ``forward`` does between them.

    Attributes:
        family: ``config.model_type`` (``"llama"``, ``"gemma2"``, …).
        config: the model's config (masks are built from it).
        embeddings: the plan's modules before the layers, by their names in the base model; the
            first maps ids ``(N, T)`` to ``(N, T, d)``, the others (dropout) map ``(N, T, d)`` to itself.
        positions: the name and module of an absolute position embedding added after the first
            (GPT-2's ``wpe``), or ``None``.
        embedding_multiplier: the factor on the token embeddings (Granite's
            ``embedding_multiplier``), or ``None``.
        rotary: the base model's ``rotary_emb`` (rotary tables from position ids), or ``None``.
        rotary_types: the layer types the rotary tables are computed for when ``rotary`` takes one
            (Gemma 3: local and global bases); empty when it takes none.
        layers: the decoder layers, in order.
        layer_types: each layer's attention (``"full_attention"``, ``"sliding_attention"``,
            ``"chunked_attention"``): the mask it gets.
        norms: the plan's modules after the layers (the final norm), by name.
        lm_head: the head's name in the CausalLM and the head, ``(N, T, d)`` → ``(N, T, vocab)``.
        logits: the operations the CausalLM's ``forward`` applies to the head's output, in order:
            ``("mul", s)``, ``("div", s)`` or ``("softcap", c)`` (``c · tanh(logits / c)``).
        init_weights: the model's ``_init_weights(module)`` (its own initialization of one submodule:
            norms, rotary tables, scaled embeddings), or ``None``; a meta-built model's stage is
            materialized with it (:mod:`lightning_gpipe.state.materialize`).
    """

    family: str
    config: Any
    embeddings: dict[str, nn.Module]
    positions: tuple[str, nn.Module] | None
    embedding_multiplier: float | None
    rotary: nn.Module | None
    rotary_types: tuple[str, ...]
    layers: list[nn.Module]
    layer_types: list[str]
    norms: dict[str, nn.Module]
    lm_head: tuple[str, nn.Module]
    logits: tuple[tuple[str, float], ...]
    init_weights: Callable[[nn.Module], None] | None = None
