"""The recipes' LightningModules on Hugging Face ``transformers`` models built from a config, cut by
:mod:`lightning_gpipe.integrations.transformers` (the ``[models]`` extra). Apart from
:mod:`recipes.modules`, so that the main job (``model=transformer``) needs no ``transformers``.
"""

from __future__ import annotations

from typing import Any

from lightning_gpipe.integrations.transformers import causal_lm, image_classifier
from recipes.models.hf import build_family, build_hf
from recipes.modules import ClassifierSteps, NextTokenSteps, _check_choice

__all__ = ["HFImageClassifier", "HFLanguageModel"]


class HFLanguageModel(NextTokenSteps):
    """Next-token language model on a Hugging Face ``transformers`` causal LM built from a config.

    ``self.layers`` is :func:`lightning_gpipe.integrations.transformers.causal_lm` of
    ``hf_class(hf_class.config_class(**config))`` (:func:`~recipes.models.hf.build_hf`): it holds
    the model's own parameters (a GPT-2 head tied to the embedding stays tied, across stages
    too). The model itself is ``self.hf``, not a submodule, so every parameter lives in
    ``self.layers``. The loss, metrics and optimizer are :class:`~recipes.modules.LanguageModel`'s: next-token
    cross-entropy on the data's ``(inputs, targets)`` windows, the same as the model's own LM
    loss on the concatenated sequence. :func:`recipes.models.hf.hf_from_checkpoint` maps a
    checkpoint back into the ``transformers`` model.

    Args:
        hf_class (str): dotted path of a causal LM class that the adapter supports,
            ``"transformers.GPT2LMHeadModel"`` (default), ``"transformers.LlamaForCausalLM"``, or
            another family that docs/models.md lists as exact.
        config (dict[str, Any] | None): the config's keyword arguments; its vocabulary must
            cover the data's token ids and its positions the data's ``seq_len`` (the recipe's
            configs read ``${data.vocab_size}`` and ``${data.seq_len}``) (default: None, the
            class's defaults). With ``family``: set on top of the family's tiny config.
        family (str | None): a ``config.model_type`` with a pipeline plan (``"llama"``,
            ``"gemma2"``, … as docs/models.md lists): the model is a tiny random one of that family
            (:func:`~recipes.models.hf.build_family`) and ``hf_class`` is not read (default: None).
        lr, weight_decay, betas, scheduler, warmup_steps, total_steps: as
            :class:`~recipes.modules.LanguageModel`.

    Shapes:
        batch: ``((N, T), (N, T))`` int64 inputs and targets; ``forward``: ``(N, T)`` → ``(N, T, vocab)``.

    Logs:
        ``train_loss`` (nats/token, progress bar), ``train_ppl``, ``val_loss``, ``val_ppl``.

    Raises:
        ImportError: without ``transformers`` (the ``[models]`` extra).
        TypeError: the adapter refuses ``hf_class``'s family
            (:class:`~lightning_gpipe.integrations.transformers.UnsupportedModelError`).
    """

    def __init__(
        self,
        hf_class: str = "transformers.GPT2LMHeadModel",
        config: dict[str, Any] | None = None,
        family: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.99),
        scheduler: str = "cosine",
        warmup_steps: int = 100,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        _check_choice("scheduler", scheduler, ("cosine", "none"))
        self.save_hyperparameters()
        # a transformers PreTrainedModel
        hf: Any = build_family(family, config or {}) if family else build_hf(hf_class, config or {})
        self.__dict__["hf"] = hf  # not a submodule: every parameter lives in self.layers
        self.layers = causal_lm(hf)
        self._add_metrics()


class HFImageClassifier(ClassifierSteps):
    """Image classifier on a Hugging Face ``transformers`` model built from a config.

    ``self.layers`` is :func:`lightning_gpipe.integrations.transformers.image_classifier` of
    ``hf_class(hf_class.config_class(**config))`` (:func:`~recipes.models.hf.build_hf`),
    holding the model's own parameters; the model itself is ``self.hf``, not a submodule. The
    loss, metrics and optimizer are :class:`~recipes.modules.ImageClassifier`'s.
    :func:`recipes.models.hf.hf_from_checkpoint` maps a checkpoint back into the model.

    Args:
        hf_class (str): dotted path of ``"transformers.ResNetForImageClassification"``
            (default) or ``"transformers.ViTForImageClassification"``.
        config (dict[str, Any] | None): the config's keyword arguments; ``num_labels`` and
            ``num_channels`` (and ViT's ``image_size``) must match the data (the recipe's
            configs read ``${data.num_classes}``, ``${data.channels}``, ``${data.resolution}``)
            (default: None, the class's defaults).
        optimizer, lr, momentum, weight_decay, label_smoothing, scheduler, warmup_steps,
            total_steps: as :class:`~recipes.modules.ImageClassifier`.

    Shapes:
        batch: ``((N, C, H, W) float, (N,) int64)``; ``forward``: ``(N, C, H, W)`` → ``(N, num_labels)``.

    Logs:
        ``train_loss`` (progress bar), ``val_loss``, ``val_acc`` (top-1, in [0, 1]).

    Raises:
        ImportError: without ``transformers`` (the ``[models]`` extra).
        TypeError: the adapter refuses ``hf_class``'s family
            (:class:`~lightning_gpipe.integrations.transformers.UnsupportedModelError`).
    """

    def __init__(
        self,
        hf_class: str = "transformers.ResNetForImageClassification",
        config: dict[str, Any] | None = None,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.0,
        scheduler: str = "cosine",
        warmup_steps: int = 20,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        _check_choice("optimizer", optimizer, ("sgd", "adamw"))
        _check_choice("scheduler", scheduler, ("cosine", "none"))
        self.save_hyperparameters()
        hf: Any = build_hf(hf_class, config or {})  # a transformers PreTrainedModel
        self.__dict__["hf"] = hf  # not a submodule: every parameter lives in self.layers
        self.layers = image_classifier(hf)
        self._add_metrics(int(hf.config.num_labels))
