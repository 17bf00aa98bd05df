"""Hugging Face ``transformers`` models built from a config (never downloaded), and back from a checkpoint.

The recipes' ``HFLanguageModel`` and ``HFImageClassifier`` (:mod:`recipes.modules`) build the
model with :func:`build_hf` and train the ``nn.Sequential`` that
:mod:`lightning_gpipe.integrations.transformers` makes of it; :func:`hf_from_checkpoint` turns a
checkpoint of such a job back into the ``transformers`` model, ready for ``save_pretrained``.
Needs the ``[models]`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hydra.utils import get_class
from torch import nn

from lightning_gpipe.integrations.transformers import causal_lm, image_classifier, original_state_dict
from lightning_gpipe.state.loading import load_structure

__all__ = ["build_hf", "hf_from_checkpoint", "hf_sequential"]

# What the recipes' modules save under ``hyper_parameters`` to rebuild the model.
CLASS_KEY, CONFIG_KEY = "hf_class", "config"
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

    Rebuilds the model from the checkpoint's ``hyper_parameters`` (``hf_class``, ``config``)
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
            "it must come from recipes.modules.HFLanguageModel or HFImageClassifier"
        )
    model = build_hf(hparams[CLASS_KEY], hparams[CONFIG_KEY])
    state = original_state_dict(model, hf_sequential(model), saved["state_dict"], prefix=PREFIX)
    model.load_state_dict(state, strict=True)
    return model
