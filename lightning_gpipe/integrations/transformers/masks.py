"""The attention mask of one decoder layer, built from the token mask with ``transformers.masking_utils``."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import masking_utils

MASKS = {
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    "chunked_attention": masking_utils.create_chunked_causal_mask,
}
"""Layer type → the ``masking_utils`` function the model's own ``forward`` builds its mask with."""


def layer_mask(
    kind: str, config: Any, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor
) -> Any:
    """The mask a layer of type ``kind`` gets, as the model's ``forward`` builds it (no cache).

    Args:
        hidden: ``(N, T, d)``, for the dtype, device and length.
        attention_mask: ``(N, T)``, 1 on real tokens and 0 on padding, or ``None`` (every token real;
            sequences packed along a row are told apart by ``position_ids`` restarting at 0).
        position_ids: ``(N, T)``.

    Returns:
        What the attention implementation of ``config`` takes: a ``(N, 1, T, T)`` mask, a
        ``BlockMask``, or ``None`` (plain causal attention).
    """
    return MASKS[kind](
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=None,
        position_ids=position_ids,
    )
