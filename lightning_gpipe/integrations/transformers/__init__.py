"""Hugging Face ``transformers`` models as an ``nn.Sequential`` the pipeline can cut, sharing their
parameters.

- :func:`causal_lm`: a decoder-only causal LM cut by its own pipeline plan
  (``config.base_model_pp_plan`` and the CausalLM's ``_pp_plan``; a built-in plan for GPT-2, GPT-Neo,
  StableLM, Falcon and GPT-BigCode, whose configs have none) → ``[embeddings, layer 0, …, layer L-1,
  final norm, head]``: token ids ``(N, T)`` or ``{"input_ids", "attention_mask", "position_ids"}`` in,
  logits ``(N, T, vocab)`` out. A
  family the chain cannot reproduce is refused at construction (:class:`UnsupportedModelError`).
- :func:`image_classifier`: ``ResNetForImageClassification`` → ``[embedder, every residual
  layer of every stage, pooler, classifier]``; ``ViTForImageClassification`` → ``[embeddings,
  layer 0, …, layer L-1, layernorm, classifier on the [CLS] token]``: pixels ``(N, C, H, W)``
  in, logits ``(N, num_labels)`` out.
- :func:`original_state_dict`: a saved ``state_dict`` of the Sequential (a checkpoint's, with
  its prefix) under the original model's keys, so that ``model.load_state_dict(...,
  strict=True)`` and ``save_pretrained`` work after training.
- :func:`plan_families`, :func:`builtin_plan_families`, :func:`shrink_config`: the causal-LM families
  with a plan in the installed transformers, those cut by a built-in plan, and a config shrunk to a
  tiny model of its family (tests, docs table).

The Sequential's layers hold the model's own submodules (no copy): training it trains the
model. A head tied to the input embedding stays tied; over several stages the pipeline keeps the
copies in step (:mod:`lightning_gpipe.partition.tied`). Between layers travels a dict whose
tensors all have the batch dimension (hidden states, the token mask, position ids, rotary
tables), so micro-batches split it; each layer builds its own attention mask on its stage.
Key-value caches are not supported (training).
"""

from lightning_gpipe.integrations.transformers.causal_lm import causal_lm
from lightning_gpipe.integrations.transformers.errors import UnsupportedModelError
from lightning_gpipe.integrations.transformers.families import builtin_plan_families, plan_families
from lightning_gpipe.integrations.transformers.image_classifier import image_classifier
from lightning_gpipe.integrations.transformers.self_check import shrink_config
from lightning_gpipe.integrations.transformers.state_dict import original_state_dict

__all__ = [
    "UnsupportedModelError",
    "builtin_plan_families",
    "causal_lm",
    "image_classifier",
    "original_state_dict",
    "plan_families",
    "shrink_config",
]
