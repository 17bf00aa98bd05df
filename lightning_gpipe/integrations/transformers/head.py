"""The LM head of a plan-cut causal LM, with its family's logit arithmetic."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PlanHead(nn.Module):
    """The head (``lm_head``) then the CausalLM's operations on the logits: ``(N, T, d)`` → ``(N, T, vocab)``.

    ``ops`` as :attr:`~lightning_gpipe.integrations.transformers.parts.CausalLMParts.logits`:
    ``("div", s)`` (Granite's ``logits_scaling``), ``("mul", s)`` (Cohere's ``logit_scale``),
    ``("softcap", c)`` (Gemma 2's ``final_logit_softcapping``: ``c · tanh(logits / c)``).
    """

    def __init__(self, name: str, lm_head: nn.Module, ops: tuple[tuple[str, float], ...]) -> None:
        super().__init__()
        self.add_module(name, lm_head)  # the model's own name: layers.4.lm_head.weight
        self.name = name
        self.ops = ops

    def forward(self, hidden: Tensor) -> Tensor:
        logits = getattr(self, self.name)(hidden)
        for op, value in self.ops:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            else:
                logits = torch.tanh(logits / value) * value
        return logits
