"""The construction-time check of :func:`~lightning_gpipe.integrations.transformers.causal_lm`: the
chained parts against the model's own ``forward``, on a tiny random model of the same family.

A family's arithmetic lives in its ``forward`` code, not in its plan; the chain reads what it knows
from the config (issue 39), and this check refuses the family when that is not all there is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedConfig

from lightning_gpipe.integrations.transformers.errors import UnsupportedModelError
from lightning_gpipe.integrations.transformers.outputs import first
from lightning_gpipe.integrations.transformers.plan import ALTERNATIVE, causal_lm_parts, sequential_of

TOLERANCE = 1e-5
"""Largest absolute difference allowed between the chain and the model (fp32)."""

SIZES = {
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8, "vocab_size": 101,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "rotary_dim": 4, "first_k_dense_replace": 1, "n_shared_experts": 1,
    "sliding_window": 3, "attention_chunk_size": 3, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "vocab_size_per_layer_input": 101, "hidden_size_per_layer_input": 8,
}  # fmt: skip
"""Config attributes a shrunken copy sets, where the original has them (and not ``None``)."""

EXPERT_COUNTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
)

_RESULTS: dict[tuple[type, str], str | None] = {}


def _get(config: Any, name: str) -> Any:
    """``config.name``, or ``None`` where it is missing or not readable globally (per-layer configs)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers raises its own error for a per-layer attribute
        return None


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001
        return False


def _set(config: Any, name: str, value: Any) -> None:
    """``config.name = value``, skipped where the config computes it (a property without a setter)."""
    try:
        setattr(config, name, value)
    except (AttributeError, TypeError, ValueError):
        pass


def shrink_config(config: Any) -> Any:
    """A copy of ``config`` for a tiny model of its family: width 32, 4 heads, vocabulary 101, one
    layer per attention type (at least 2), sliding windows and chunks of 3 (any integer attribute
    named ``*window*`` or ``*chunk*``), no dropout; a vision or audio tower's config shrunk alike.
    So that the check sees every factor, float multipliers and scales (``*multiplier*``,
    ``*scaling*``, ``*scale*``) are made 1.5 times larger and soft-caps (``*softcap*``) 0.5.

    Per-layer lists (``no_rope_layers``…) keep their first entries; ``layer_types`` keeps one layer
    of each type, in order of first appearance.
    """
    config = copy.deepcopy(config)
    for name, value in list(vars(config).items()):
        if isinstance(value, PreTrainedConfig):
            _set(config, name, shrink_config(value))
    layers = _get(config, "num_hidden_layers")
    types = _get(config, "layer_types")
    distinct = list(dict.fromkeys(types)) if isinstance(types, (list, tuple)) else []
    count = max(2, len(distinct))
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            _set(config, name, 0.0)
        elif isinstance(value, list) and layers and len(value) == layers and name != "layer_types":
            _set(config, name, value[:count])
        elif isinstance(value, float) and "softcap" in name:  # active on a tiny model's small logits
            _set(config, name, 0.5)
        elif isinstance(value, float) and any(k in name for k in ("multiplier", "scaling", "scale")):
            _set(config, name, value * 1.5)  # off 1.0, so a factor left out shows
        elif type(value) is int and ("window" in name or "chunk" in name):
            _set(config, name, SIZES["sliding_window"])
    for name, value in SIZES.items():
        current = _get(config, name)
        if isinstance(current, list):  # per layer (Gemma 3n's intermediate_size)
            _set(config, name, [value] * len(current))
        elif current is not None:
            _set(config, name, value)
    if _get(config, "moe_intermediate_size") is not None:  # experts, also where a default leaves them None
        for name in EXPERT_COUNTS:
            if _has(config, name):
                _set(config, name, SIZES[name])
    if _get(config, "rope_parameters") == {} and distinct:  # a default config without them (Cohere Compass)
        default = {"rope_type": "default", "rope_theta": 10000.0}
        _set(config, "rope_parameters", {kind: dict(default) for kind in distinct})
    if _has(config, "head_dim"):  # None means "hidden_size // heads" to some families, and breaks others
        _set(config, "head_dim", SIZES["head_dim"])
    if _get(config, "num_key_value_heads") is not None:
        grouped = config.num_key_value_heads != _get(config, "num_attention_heads")
        latent = _get(config, "kv_lora_rank") is not None  # multi-head latent attention: no groups
        _set(config, "num_key_value_heads", 2 if grouped and not latent else 4)
    if _get(config, "num_kv_shared_layers"):
        _set(config, "num_kv_shared_layers", 0)  # Gemma 3n: with one layer per type, none is left to share
    if layers is not None:
        _set(config, "num_hidden_layers", count)
    if distinct:
        _set(config, "layer_types", [distinct[i % len(distinct)] for i in range(count)])
    return config


def check_batch(vocab: int, n: int = 3, t: int = 8, seed: int = 0) -> dict[str, Tensor]:
    """``{"input_ids": (n, t), "attention_mask": (n, t)}``: row 0 unpadded, row 1 left-padded by 3,
    row 2 right-padded by 2 (rows beyond repeat the pattern)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    for row in range(n):
        if row % 3 == 1:
            mask[row, :3] = 0
        elif row % 3 == 2:
            mask[row, t - 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _largest(a: Tensor, b: Tensor, real: Tensor) -> float:
    """max |a - b| over the real tokens (``real`` (N, T) bool); inf when shapes or NaNs differ."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a[real].double(), b[real].double()
    if not torch.equal(a.isnan(), b.isnan()):
        return float("inf")
    return float((a - b).nan_to_num().abs().max()) if a.numel() else 0.0


def first_difference(model: nn.Module, seq: nn.Sequential, batch: dict[str, Tensor]) -> str | None:
    """Where the chain ``seq`` first differs from ``model``'s own ``forward`` on ``batch`` by more
    than :data:`TOLERANCE` (the embeddings' output, a layer's, the final norm's or the logits), on
    real tokens; ``None`` when nowhere."""
    parts = causal_lm_parts(model)
    seen: dict[str, Tensor] = {}

    def keep(where: str, value: Any) -> None:
        seen.setdefault(where, first(value))

    hooks = [
        parts.layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: keep(
                "the embeddings' output", args[0] if args else kwargs["hidden_states"]
            ),
            with_kwargs=True,
        )
    ]
    for i, layer in enumerate(parts.layers):
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: keep(f"layer {i}", out)))
    if parts.norms:
        hooks.append(
            list(parts.norms.values())[-1].register_forward_hook(
                lambda m, a, out: keep("the final norm", out)
            )
        )
    try:
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits
    except Exception as error:  # noqa: BLE001 - the family's own forward fails: refused, by name
        return f"its own forward fails on a padded batch ({_short(error)})"
    finally:
        for hook in hooks:
            hook.remove()
    mine: dict[str, Tensor] = {}
    with torch.no_grad():
        x: Any = batch
        for k, layer in enumerate(seq):
            x = layer(x)
            if k == 0:
                mine["the embeddings' output"] = x["hidden_states"]
            elif k <= len(parts.layers):
                mine[f"layer {k - 1}"] = x["hidden_states"]
            elif k == len(seq) - 2:
                mine["the final norm"] = x
    mine["the logits"], seen["the logits"] = x, logits
    real = batch["attention_mask"].bool()
    for where, value in mine.items():
        if where in seen:
            diff = _largest(value, seen[where], real)
            if diff > TOLERANCE:
                kind = f" ({parts.layer_types[int(where[6:])]})" if where.startswith("layer ") else ""
                forward = f"{type(model).__name__}.forward"
                verb = "differ" if where == "the logits" else "differs"
                return f"{where}{kind} {verb} from {forward} by {diff:.3g} (tolerance {TOLERANCE:g})"
    return None


def _tiny(model: nn.Module, config: Any) -> nn.Module:
    """A tiny random model of ``model``'s class from ``config`` (its shrunken config), fp32, eval."""
    implementation = getattr(model.config, "_attn_implementation", None)
    config._attn_implementation = implementation if implementation in ("eager", "sdpa") else "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # also under a meta-device context
        torch.manual_seed(0)
        tiny = type(model)(config)
    return tiny.float().eval()


def check_family(model: nn.Module) -> None:
    """Refuse ``model``'s family unless the chain of its parts computes what its ``forward`` does.

    A tiny random model of the family (:func:`shrink_config` of ``model.config``, fp32, eval) runs
    its ``forward`` and the chain on :func:`check_batch` (left and right padding, windows shorter
    than the sequence); the verdict is cached per class and shrunken config.

    Raises:
        UnsupportedModelError: the tiny model cannot be built or run, the chain raises, or the
            chain differs (the message names the family, the first part that differs, and by how much).
    """
    family = str(getattr(model.config, "model_type", type(model).__name__))
    try:
        config = shrink_config(model.config)
        key = (type(model), config.to_json_string())
    except Exception as error:  # noqa: BLE001 - any failure refuses the family, by name
        config, key = None, (type(model), f"unshrinkable {id(model.config)}")
        _RESULTS[key] = f"its config cannot be shrunk to a tiny model's ({_short(error)})"
    if key not in _RESULTS:
        with torch.device(
            "cpu"
        ):  # the tiny model and its forward on the CPU, under a meta-device context too
            _RESULTS[key] = _verdict(model, config)
    if _RESULTS[key] is not None:
        raise UnsupportedModelError(
            f"causal_lm cannot reproduce {family} ({type(model).__name__}) from its pipeline plan: on a tiny "
            f"random {family} (fp32, with padding), {_RESULTS[key]}; {ALTERNATIVE}"
        )


def _short(error: Exception) -> str:
    """``Type: message``, first line, at most 160 characters."""
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return text if len(text) <= 160 else text[:157] + "..."


def _verdict(model: nn.Module, config: Any) -> str | None:
    """What differs on a tiny model of ``model``'s family, or ``None``; ``model`` itself is that
    model when it is already as tiny as ``config`` (fp32, run in eval mode, its mode restored)."""
    own: Any = model.config  # a transformers PretrainedConfig
    if config.to_json_string() == own.to_json_string() and _float32(model):
        training = model.training
        try:
            return _compare(model.eval())
        finally:
            model.train(training)
    try:
        tiny = _tiny(model, config)
    except Exception as error:  # noqa: BLE001 - any failure refuses the family, by name
        return f"a tiny model from a shrunken copy of its config cannot be built ({_short(error)})"
    return _compare(tiny)


def _float32(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def _compare(tiny: nn.Module) -> str | None:
    """:func:`first_difference` of ``tiny`` and the chain of its parts on :func:`check_batch`."""
    batch = check_batch(int(_get(tiny.config, "vocab_size") or SIZES["vocab_size"]))
    try:
        with torch.random.fork_rng(devices=[]):
            return first_difference(tiny, sequential_of(causal_lm_parts(tiny)), batch)
    except UnsupportedModelError as error:
        return str(error).split(": ", 1)[-1].split("; ")[0]
    except Exception as error:  # noqa: BLE001
        return f"the chain of its parts raises {_short(error)}"
