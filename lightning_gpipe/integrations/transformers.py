"""Hugging Face ``transformers`` models as an ``nn.Sequential`` the pipeline can cut, sharing their
parameters.

- :func:`causal_lm`: a GPT-2 or Llama-family causal LM (``GPT2LMHeadModel``,
  ``LlamaForCausalLM`` and models laid out like it: ``model.embed_tokens``, ``model.layers``,
  ``model.norm``, ``model.rotary_emb``, ``lm_head``) → ``[embeddings, block 0, …, block L-1,
  final norm, head]``: token ids ``(N, T)`` (int64) in, logits ``(N, T, vocab)`` out.
- :func:`image_classifier`: ``ResNetForImageClassification`` → ``[embedder, every residual
  layer of every stage, pooler, classifier]``; ``ViTForImageClassification`` → ``[embeddings,
  layer 0, …, layer L-1, layernorm, classifier on the [CLS] token]``: pixels ``(N, C, H, W)``
  in, logits ``(N, num_labels)`` out.
- :func:`original_state_dict`: a saved ``state_dict`` of the Sequential (a checkpoint's, with
  its prefix) under the original model's keys, so that ``model.load_state_dict(...,
  strict=True)`` and ``save_pretrained`` work after training.

The Sequential's layers hold the model's own submodules (no copy): training it trains the
model. A GPT-2 LM head tied to the input embedding stays tied; over several stages the pipeline
keeps the copies in step (:mod:`lightning_gpipe.partition.tied`). Between layers travels a tensor (GPT-2,
ResNet, ViT) or ``(hidden (N, T, d), cos (N, T, r), sin (N, T, r))`` (Llama: the rotary tables
are computed once, in the embedding layer, per sequence, so every tensor has the batch
dimension). Attention is causal with an explicit ``(1, 1, T, T)`` additive mask built in each
block, for every attention implementation; padding masks and key-value caches are not
supported (training on packed, unpadded sequences).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["causal_lm", "image_classifier", "original_state_dict"]


def _first(out: Any) -> Tensor:
    """A transformers layer returns a tensor or a tuple whose first element is the hidden state."""
    return out[0] if isinstance(out, (tuple, list)) else out


def causal_mask(length: int, like: Tensor) -> Tensor:
    """``(1, 1, T, T)`` additive causal mask: 0 on and below the diagonal, the dtype's minimum above."""
    upper = torch.ones(length, length, dtype=torch.bool, device=like.device).triu(1)
    mask = torch.zeros(length, length, dtype=like.dtype, device=like.device)
    return mask.masked_fill(upper, torch.finfo(like.dtype).min)[None, None]


class GPT2Embeddings(nn.Module):
    """Token plus position embeddings and dropout: ``(N, T)`` ids → ``(N, T, d)``."""

    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions)[None])


class GPT2Block(nn.Module):
    """One decoder block, causal: ``(N, T, d)`` → ``(N, T, d)``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Tensor) -> Tensor:
        return _first(self.block(hidden, attention_mask=causal_mask(hidden.shape[1], hidden)))


class LlamaEmbeddings(nn.Module):
    """Token embeddings and the rotary tables: ``(N, T)`` ids → ``(hidden, cos, sin)``, each ``(N, T, ·)``."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = model.embed_tokens, model.rotary_emb

    def forward(self, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.embed_tokens(input_ids)
        n, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(n, t)
        cos, sin = self.rotary_emb(hidden, positions)
        return hidden, cos, sin


class LlamaBlock(nn.Module):
    """One decoder layer, causal: ``(hidden, cos, sin)`` → ``(hidden', cos, sin)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        hidden, cos, sin = inputs
        n, t = hidden.shape[:2]
        positions = torch.arange(t, device=hidden.device).expand(n, t)
        out = self.layer(
            hidden,
            attention_mask=causal_mask(t, hidden),
            position_ids=positions,
            position_embeddings=(cos, sin),
        )
        return _first(out), cos, sin


class FinalNorm(nn.Module):
    """The final norm; drops the rotary tables Llama's blocks carry: ``(N, T, d)``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
        return self.norm(inputs[0] if isinstance(inputs, tuple) else inputs)


def causal_lm(model: Any) -> nn.Sequential:
    """``[embeddings, blocks…, final norm, lm_head]`` sharing ``model``'s parameters (GPT-2 or Llama family).

    Args:
        model: a ``GPT2LMHeadModel`` (``transformer.{wte, wpe, drop, h, ln_f}``, ``lm_head``) or a
            ``LlamaForCausalLM``-like model (``model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``).

    Returns:
        ``nn.Sequential`` mapping ids ``(N, T)`` to logits ``(N, T, vocab)``; ``len == layers + 3``.

    Raises:
        TypeError: ``model`` has neither layout.
    """
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):
        t = model.transformer
        blocks: list[nn.Module] = [GPT2Block(b) for b in t.h]
        return nn.Sequential(GPT2Embeddings(t), *blocks, FinalNorm(t.ln_f), model.lm_head)
    inner = getattr(model, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        decoders = [LlamaBlock(layer) for layer in inner.layers]
        return nn.Sequential(LlamaEmbeddings(inner), *decoders, FinalNorm(inner.norm), model.lm_head)
    raise TypeError(
        f"causal_lm supports GPT-2 (transformer.h) and Llama-family (model.layers) causal LMs, not "
        f"{type(model).__name__}; build the nn.Sequential by hand for other layouts"
    )


class Unwrap(nn.Module):
    """A layer called on the hidden state alone, its first output kept: ``(N, *)`` → ``(N, *)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor) -> Tensor:
        return _first(self.layer(hidden))


class ClsHead(nn.Module):
    """The classifier on the first ([CLS]) token: ``(N, T, d)`` → ``(N, num_labels)``."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, hidden: Tensor) -> Tensor:
        return self.classifier(hidden[:, 0, :])


def image_classifier(model: Any) -> nn.Sequential:
    """The image classifier as an ``nn.Sequential`` sharing ``model``'s parameters.

    Args:
        model: ``ResNetForImageClassification`` (``resnet.{embedder, encoder.stages, pooler}``,
            ``classifier``) or ``ViTForImageClassification`` (``vit.{embeddings, layers,
            layernorm}``, ``vit.encoder.layer`` before transformers 5, ``classifier``).

    Returns:
        ``nn.Sequential`` mapping pixels ``(N, C, H, W)`` to logits ``(N, num_labels)``.

    Raises:
        TypeError: ``model`` has neither layout.
    """
    if hasattr(model, "resnet"):
        r = model.resnet
        layers = [layer for stage in r.encoder.stages for layer in stage.layers]
        return nn.Sequential(r.embedder, *layers, r.pooler, model.classifier)
    if hasattr(model, "vit"):
        v = model.vit
        layers = v.layers if hasattr(v, "layers") else v.encoder.layer  # transformers 5 / 4
        blocks = [Unwrap(layer) for layer in layers]
        return nn.Sequential(Unwrap(v.embeddings), *blocks, v.layernorm, ClsHead(model.classifier))
    raise TypeError(
        f"image_classifier supports ResNetForImageClassification and ViTForImageClassification, not "
        f"{type(model).__name__}; build the nn.Sequential by hand for other layouts"
    )


def original_state_dict(
    model: nn.Module, sequential: nn.Sequential, state_dict: Mapping[str, Any], prefix: str = ""
) -> dict[str, Any]:
    """``state_dict`` (the Sequential's keys after ``prefix``) under ``model``'s own ``state_dict`` keys.

    ``sequential`` must be the adapter built from ``model`` (they share tensors, which is how keys
    are matched). A tensor the model lists under several keys (a tied head) fills all of them.

    Args:
        prefix: where the Sequential sits in ``state_dict``, e.g. ``"layers."`` for a
            LightningModule's checkpoint whose Sequential is ``self.layers``.

    Returns:
        A dict that ``model.load_state_dict(..., strict=True)`` accepts.

    Raises:
        KeyError: a key of ``model`` has no counterpart in ``sequential`` or in ``state_dict``
            (the message names it).
    """
    by_id: dict[int, str] = {}
    for key, tensor in sequential.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), key)
    out: dict[str, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        source = by_id.get(id(tensor))
        if source is None:
            raise KeyError(
                f"{key!r} of {type(model).__name__} is not held by the Sequential; build it with adapters"
            )
        if prefix + source not in state_dict:
            raise KeyError(f"{prefix + source!r} (the model's {key!r}) is missing from the state_dict")
        out[key] = state_dict[prefix + source]
    return out
