"""The gradient norms the tensor-parallel test models record, the same way in each (gpt.py, llama.py)."""

from __future__ import annotations

import importlib
import os

import torch

pl = importlib.import_module(os.environ.get("GPIPE_TEST_LIGHTNING", "pytorch_lightning"))
grad_norm = importlib.import_module(pl.__name__ + ".utilities").grad_norm


def before_optimizer_step(module) -> None:
    """In ``on_before_optimizer_step``: Lightning's ``grad_norm(module)`` total into ``module.hook_norms``
    (the whole model's on every rank, issue 40); on one device also the norm before Lightning clips into
    ``module.norms``."""
    module.hook_norms.append(float(grad_norm(module, norm_type=2)["grad_2.0_norm_total"]))
    if module.trainer.world_size == 1:  # Lightning clips after this hook
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        module.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def after_batch(module) -> None:
    """In ``on_train_batch_end``: the strategy's global norm before clipping into ``module.norms``."""
    norm = getattr(module.trainer.strategy, "last_grad_norm", None)
    if norm is not None:
        module.norms.append(float(norm))
