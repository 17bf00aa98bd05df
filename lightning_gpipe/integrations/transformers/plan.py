"""A causal LM's parts, found by its pipeline plan, and the ``nn.Sequential`` chained from them."""

from __future__ import annotations

import inspect
from typing import Any

import transformers
from torch import nn

from lightning_gpipe.integrations.transformers.block import PlanBlock
from lightning_gpipe.integrations.transformers.embeddings import PlanEmbeddings
from lightning_gpipe.integrations.transformers.errors import UnsupportedModelError
from lightning_gpipe.integrations.transformers.final_norm import PlanNorm
from lightning_gpipe.integrations.transformers.head import PlanHead
from lightning_gpipe.integrations.transformers.masks import MASKS
from lightning_gpipe.integrations.transformers.parts import CausalLMParts

INFERRED_PLANS = {
    "gpt2": (("wte", "drop", "h", "ln_f"), "wpe"),
    "gpt_bigcode": (("wte", "drop", "h", "ln_f"), "wpe"),
    "gpt_neo": (("wte", "drop", "h", "ln_f"), "wpe"),
    "stablelm": (("embed_tokens", "layers", "norm"), None),
    "falcon": (("word_embeddings", "h", "ln_f"), None),
}
"""Built-in plans for popular families whose config has none (transformers 5.25 gives GPT-2,
StarCoder's GPT-BigCode, GPT-Neo, StableLM and Falcon no ``base_model_pp_plan``), by ``model_type``:
the base model's part names in call order, and the absolute position embedding added after the first
(GPT-2's ``wpe``). The construction-time check still decides (Falcon with ALiBi is refused there)."""

MULTIPLIES_LOGITS_SCALING = frozenset({"hyperclovax"})
"""Families whose ``forward`` multiplies the logits by ``config.logits_scaling`` (Granite and the
others divide)."""

ALTERNATIVE = (
    "build the nn.Sequential by hand (docs/models.md, 'The Sequential'); docs/models.md lists the families "
    "causal_lm cuts"
)


def _refuse(family: str, model: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"causal_lm cannot cut {family} ({type(model).__name__}, transformers {transformers.__version__}): "
        f"{why}; {ALTERNATIVE}"
    )


def _plan(model: Any, family: str, base: nn.Module) -> tuple[list[str], str | None]:
    """The base model's part names in call order and the absolute position embedding's name."""
    plan = getattr(model.config, "base_model_pp_plan", None)
    if plan:
        return list(plan), None
    if family in INFERRED_PLANS:
        names, positions = INFERRED_PLANS[family]
        return list(names), positions
    raise _refuse(family, model, "its config has no pipeline plan (config.base_model_pp_plan)")


def _layer_types(config: Any, base: nn.Module, count: int) -> list[str]:
    """Each layer's attention type: ``config.layer_types``, else sliding for every layer when the
    base model's ``forward`` builds a sliding-window mask and ``config.sliding_window`` is set
    (Mistral), else full."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) >= count:
        return list(types[:count])
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        source = ""
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and "create_sliding_window_causal_mask" in source
    return ["sliding_attention" if sliding else "full_attention"] * count


def _rotary_types(rotary: nn.Module, layer_types: list[str]) -> tuple[str, ...]:
    """The layer types ``rotary`` has tables for: all of ``layer_types``, less those its per-type
    ``rope_type`` dict lacks (Beam's full-attention layers have no rotary embedding)."""
    known = getattr(rotary, "rope_type", None)
    return tuple(t for t in sorted(set(layer_types)) if not isinstance(known, dict) or t in known)


def _logit_ops(model: Any, family: str) -> tuple[tuple[str, float], ...]:
    config = model.config
    ops: list[tuple[str, float]] = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        ops.append(("mul" if family in MULTIPLIES_LOGITS_SCALING else "div", float(scaling)))
    scale = getattr(model, "logit_scale", getattr(config, "logit_scale", None))
    if isinstance(scale, (int, float)):
        ops.append(("mul", float(scale)))
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        ops.append(("softcap", float(cap)))
    return tuple(ops)


def causal_lm_parts(model: Any) -> CausalLMParts:
    """The parts of ``model`` named by its pipeline plan, and its family's arithmetic read from its config.

    Raises:
        UnsupportedModelError: ``model`` is not a transformers model, is an encoder-decoder, has no
            plan and no layout a plan can be assumed for, its plan names no single ``ModuleList`` of
            layers, or a layer type has no mask here (linear attention, recurrent layers); the
            message names the family and the alternative.
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, nn.Module) or not hasattr(model, "base_model"):
        raise UnsupportedModelError(
            f"causal_lm takes a transformers causal LM (a PreTrainedModel such as LlamaForCausalLM), "
            f"not {type(model).__name__}; {ALTERNATIVE}"
        )
    family = str(getattr(config, "model_type", type(model).__name__))
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(family, model, "it is an encoder-decoder; causal_lm cuts decoder-only models")
    base: nn.Module = model.base_model  # type: ignore[assignment]  # a PreTrainedModel attribute
    names, positions = _plan(model, family, base)
    missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
    if missing:
        raise _refuse(family, model, f"its plan names {missing}, which {type(base).__name__} does not hold")
    lists = [i for i, n in enumerate(names) if isinstance(getattr(base, n), nn.ModuleList)]
    if len(lists) != 1:
        raise _refuse(family, model, f"its plan {names} names {len(lists)} ModuleLists of layers, not one")
    head_plan = getattr(model, "_pp_plan", None) or {"lm_head": None}
    heads = [n for n in head_plan if isinstance(getattr(model, n, None), nn.Module)]
    if len(heads) != 1:
        raise _refuse(family, model, f"its head plan {list(head_plan)} names no single head module")
    layers = list(getattr(base, names[lists[0]]))[: getattr(config, "num_hidden_layers", None)]
    layer_types = _layer_types(config, base, len(layers))
    unknown = sorted(set(layer_types) - set(MASKS))
    if unknown:
        raise _refuse(
            family,
            model,
            f"layer types {unknown} (config.layer_types) have no mask here; only {sorted(MASKS)} do",
        )
    parts = [*(getattr(base, n) for n in names), *layers, getattr(model, heads[0])]
    if positions:
        parts.append(getattr(base, positions))
    held = {id(p) for part in parts for p in part.parameters()}
    outside = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters() if id(p) not in held})
    if outside:
        shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise _refuse(family, model, f"it holds parameters outside its plan's parts ({shown})")
    rotary = getattr(base, "rotary_emb", None)
    takes_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    multiplier = getattr(base, "embedding_multiplier", getattr(config, "embedding_multiplier", None))
    return CausalLMParts(
        family=family,
        config=config,
        embeddings={n: getattr(base, n) for n in names[: lists[0]]},
        positions=(positions, getattr(base, positions)) if positions else None,
        embedding_multiplier=float(multiplier) if isinstance(multiplier, (int, float)) else None,
        rotary=rotary,
        rotary_types=_rotary_types(rotary, layer_types) if rotary is not None and takes_type else (),
        layers=layers,
        layer_types=layer_types,
        norms={n: getattr(base, n) for n in names[lists[0] + 1 :]},
        lm_head=(heads[0], getattr(model, heads[0])),
        logits=_logit_ops(model, family),
        init_weights=getattr(model, "_init_weights", None),
    )


def sequential_of(parts: CausalLMParts) -> nn.Sequential:
    """``[embeddings, layer 0, …, layer L-1, final norm, head]`` holding ``parts``' modules (no copy).

    Each layer carries ``parts.init_weights`` as ``initialize_module``: a stage of a model built on
    the meta device gets the model's own initialization
    (:func:`lightning_gpipe.state.materialize.initialize_layer`).
    """
    if not parts.embeddings:
        raise UnsupportedModelError(
            f"the plan of {parts.family} names no embedding before its layers; {ALTERNATIVE}"
        )
    blocks = [
        PlanBlock(layer, kind, parts.config, i)
        for i, (layer, kind) in enumerate(zip(parts.layers, parts.layer_types))
    ]
    layers = [PlanEmbeddings(parts), *blocks, PlanNorm(parts.norms), PlanHead(*parts.lm_head, parts.logits)]
    if parts.init_weights is not None:
        for layer in layers:  # not a submodule: how a meta-built stage initializes its modules
            layer.__dict__["initialize_module"] = parts.init_weights
    return nn.Sequential(*layers)
