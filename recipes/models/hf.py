"""Hugging Face ``transformers`` models built from a config (never downloaded), and back from a checkpoint.

The recipes' ``HFLanguageModel`` and ``HFImageClassifier`` (:mod:`recipes.hf_modules`) build the
model with :func:`build_hf` and train the ``nn.Sequential`` that
:mod:`lightning_gpipe.integrations.transformers` makes of it; :func:`hf_from_checkpoint` turns a
checkpoint of such a job back into the ``transformers`` model, ready for ``save_pretrained``.
Needs the ``[models]`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import transformers
from hydra.utils import get_class
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from lightning_gpipe.integrations.transformers import (
    builtin_plan_families,
    causal_lm,
    image_classifier,
    original_state_dict,
    plan_families,
    shrink_config,
)
from lightning_gpipe.state.loading import load_structure

__all__ = ["build_family", "build_hf", "hf_from_checkpoint", "hf_sequential"]

# What the recipes' modules save under ``hyper_parameters`` to rebuild the model.
CLASS_KEY, CONFIG_KEY, FAMILY_KEY = "hf_class", "config", "family"
# Float attributes of a config that ``shrink_config`` changes so that its check sees them.
ARITHMETIC = ("softcap", "multiplier", "scaling", "scale")
# Where the recipes' modules keep the adapter: a checkpoint's ``state_dict`` keys start with it.
PREFIX = "layers."


def build_hf(hf_class: str, config: Mapping[str, Any]) -> nn.Module:
    """``hf_class(hf_class.config_class(**config))``: a randomly initialised model, no download.

    Args:
        hf_class (str): dotted path of a ``transformers`` model class, e.g.
            ``"transformers.GPT2LMHeadModel"`` or ``"transformers.ViTForImageClassification"``.
        config (Mapping[str, Any]): keyword arguments of the class's config
            (``GPT2Config(n_layer=2, ...)``).

    Returns:
        nn.Module: the ``transformers`` model (a ``PreTrainedModel``).

    Raises:
        ImportError: if ``transformers`` is missing; install the ``[models]`` extra.
        TypeError: if ``hf_class`` has no ``config_class`` (not a ``transformers`` model).
    """
    try:
        import transformers  # noqa: F401  (only to say which extra is missing)
    except ImportError as err:
        raise ImportError(
            f"the {hf_class} recipe needs transformers; pip install -e '.[models]' (after torch)"
        ) from err
    cls = get_class(hf_class)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise TypeError(f"hf_class is not a transformers model class (hf_class: {hf_class}); name one")
    return cls(config_class(**config))


def build_family(family: str, config: Mapping[str, Any]) -> nn.Module:
    """A tiny randomly initialised causal LM of ``family``, no download.

    The config is :func:`~lightning_gpipe.integrations.transformers.shrink_config` of the family's
    default config (width 32, 4 heads, one layer per attention type and at least 2, sliding windows
    and chunks of 3 tokens) with the family's own soft-caps, multipliers and scales (which
    ``shrink_config`` changes for its check), then ``config``'s entries set on it (the recipe's
    vocabulary, positions and token ids; any other attribute, e.g. ``hidden_size``). The class is the family's
    ``AutoModelForCausalLM`` one.

    Args:
        family (str): a ``config.model_type`` whose config carries a ``base_model_pp_plan``
            (``"llama"``, ``"gemma2"``, ``"mistral"``, …), or one ``causal_lm`` has a built-in plan for
            (``"stablelm"``, ``"gpt_neo"``, ``"falcon"``, …); docs/models.md lists them.
        config (Mapping[str, Any]): attributes to set on the tiny config.

    Returns:
        nn.Module: the ``transformers`` model (a ``PreTrainedModel``), in float32.

    Raises:
        ValueError: ``family`` is not a causal LM with a pipeline plan, its own or a built-in one (the
            message lists them).
    """
    classes = dict(plan_families() + builtin_plan_families())
    if family not in classes:
        raise ValueError(
            f"model.family must be a causal-LM family with a pipeline plan, its own or a built-in one "
            f"(family: {family!r}); "
            f"one of {sorted(classes)}"
        )
    default = CONFIG_MAPPING[family]()
    tiny = shrink_config(default)
    for name, value in vars(default).items():  # the family's own soft-caps and scales, not the check's
        if isinstance(value, float) and any(k in name for k in ARITHMETIC):
            setattr(tiny, name, value)
    for name, value in config.items():
        setattr(tiny, name, value)
    return getattr(transformers, classes[family])(tiny)


def hf_sequential(model: nn.Module) -> nn.Sequential:
    """The adapter of ``model``: :func:`~lightning_gpipe.integrations.transformers.causal_lm` for a causal LM,
    :func:`~lightning_gpipe.integrations.transformers.image_classifier` for an image classifier.

    Raises:
        TypeError: if the adapters support neither layout (the message names the class).
    """
    try:
        return causal_lm(model)
    except TypeError:
        return image_classifier(model)


def hf_from_checkpoint(path: str | os.PathLike) -> nn.Module:
    """The ``transformers`` model a recipe checkpoint holds, loaded with ``strict=True``.

    Rebuilds the model from the checkpoint's ``hyper_parameters`` (``hf_class``, ``config``; or
    ``family`` and ``config``, :func:`build_family`)
    and maps ``state_dict`` (keys ``layers.<i>...``) to the model's own keys with
    :func:`~lightning_gpipe.integrations.transformers.original_state_dict`; a tied head is filled from the one
    stored tensor. The file is read with torch's safe unpickler.

    Args:
        path (str | os.PathLike): a Lightning checkpoint of ``HFLanguageModel`` or
            ``HFImageClassifier`` (``checkpoint_format: full``).

    Returns:
        nn.Module: the trained model, in training mode; ``model.save_pretrained(dir)`` works.

    Raises:
        KeyError: if the checkpoint lacks ``hf_class``/``config`` hyperparameters or a weight of
            the model (the message names it).
    """
    saved = load_structure(path, map_location="cpu")
    hparams = saved.get("hyper_parameters", {})
    missing = [key for key in (CLASS_KEY, CONFIG_KEY) if key not in hparams]
    if missing:
        raise KeyError(
            f"checkpoint has no {missing} hyperparameters (file: {os.fspath(path)}); "
            "it must come from recipes.hf_modules.HFLanguageModel or HFImageClassifier"
        )
    if hparams.get(FAMILY_KEY):
        model = build_family(hparams[FAMILY_KEY], hparams[CONFIG_KEY])
    else:
        model = build_hf(hparams[CLASS_KEY], hparams[CONFIG_KEY])
    state = original_state_dict(model, hf_sequential(model), saved["state_dict"], prefix=PREFIX)
    model.load_state_dict(state, strict=True)
    return model
