"""Mixed precision across stages: one found-inf decision and one loss scale for the whole job.

With ``precision="16-mixed"`` each stage's ``GradScaler`` checks only its own gradients. If one
stage found an inf and skipped its step while another stepped, the stages would drift apart and
their scales would diverge. :class:`PipelineGradScaler` all-reduces the found-inf flag (max)
over every rank right after unscaling, so all stages and replicas skip together or step
together, and ``update()`` moves every rank's scale identically.

Under a tensor-parallel plan an optimizer holds ``DTensor`` gradients beside plain ones (the
parameters the plan leaves alone), which ``torch.amp.GradScaler`` unscales in one foreach call per
device and dtype, refused by ``DTensor`` ("got mixed torch.Tensor and DTensor"); the scaler here
unscales plain gradients and each device mesh's ``DTensor`` gradients in calls of their own (issue 42,
item 4).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_gpipe._compat import scaler_device, scaler_optimizer_state, scaler_scale


class PipelineGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose found-inf decision is agreed by all ranks of ``group``.

    Args:
        device: the device of the scaler (``"cuda"`` or ``"cpu"``).
        group: process group to agree over (default: the world).
        **kwargs: as for ``torch.amp.GradScaler``.
    """

    def __init__(self, device: str = "cuda", group: Any = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.group = group

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler, group: Any = None) -> PipelineGradScaler:
        """A copy of ``scaler`` (same device, scale, growth settings and tracker) that agrees over
        ``group``."""
        new = cls(scaler_device(scaler), group=group, enabled=scaler.is_enabled())
        new.load_state_dict(scaler.state_dict())
        return new

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """``GradScaler``'s unscaling, once for the plain gradients and once for each device mesh's
        ``DTensor`` gradients (one foreach call may not mix them); per device, the largest found-inf."""
        kinds: dict[Any, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                kinds.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(p)
        if len(kinds) < 2:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        found: dict[torch.device, torch.Tensor] = {}
        for params in kinds.values():
            part = cast(Optimizer, SimpleNamespace(param_groups=[{"params": params}]))
            for device, flag in super()._unscale_grads_(part, inv_scale, found_inf, allow_fp16).items():
                found[device] = torch.maximum(found[device], flag) if device in found else flag
        return found

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled() or not dist.is_available() or not dist.is_initialized():
            return
        state = scaler_optimizer_state(self, optimizer)
        scale = scaler_scale(self)
        assert scale is not None
        device = scale.device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for flag in state["found_inf_per_device"].values():
            found = torch.maximum(found, flag.to(device, torch.float32).reshape(1))
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        # one entry, on the scale's device: step() skips on it and update() reads it
        state["found_inf_per_device"] = {device: found}


def install(precision_plugin: Any, clip_grad_by_norm: Any) -> None:
    """Make Lightning's precision plugin clip by ``clip_grad_by_norm(optimizer, clip_val)`` (the global
    norm over every stage) and agree on found-infs (a :class:`PipelineGradScaler` in place of its scaler)."""
    precision_plugin.clip_grad_by_norm = clip_grad_by_norm
    scaler = getattr(precision_plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, PipelineGradScaler):
        precision_plugin.scaler = PipelineGradScaler.from_scaler(scaler)
