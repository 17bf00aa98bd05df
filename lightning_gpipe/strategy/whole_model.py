"""The whole model where the user's code means it: the gradient hooks see every stage's parameters (issue 40).

On one device ``on_after_backward``, ``on_before_optimizer_step`` and ``configure_gradient_clipping``
(the LightningModule's and the callbacks') see the model's every parameter and gradient: Lightning's
documented ``self.log_dict(grad_norm(self, norm_type=2))``, a hand
``torch.nn.utils.clip_grad_norm_(self.parameters(), c)``, ``sum(p.numel() for p in self.parameters())``.
Under the strategy a rank holds one stage.
Inside those hooks :class:`WholeParameters` makes the LightningModule's ``parameters()`` and
``named_parameters()`` the whole model's, in the model's order and under its names: this stage's
parameters themselves, the others' as copies of their values and gradients, gathered from the
pipeline's stages at the first call in the hook (a collective: every rank runs the hook) and kept to
its end (gathered again after Lightning's ``gradient_clip_val`` clipping, which changes the stages'
own gradients). Every rank runs the same hook code on the same values, so what the code computes is the
same on every rank, and what it changes in place (a hand clip scales the gradients) it changes on
every stage's own parameters as on one device; the copies' changes are dropped with them. Data-parallel
replicas hold equal gradients at these hooks (averaged in the backward), so one pipeline's view is
the model's.

A stage's ``DTensor`` parameters (tensor parallelism, ``data_parallel="fsdp"``) appear as plain whole
copies too (their ``full_tensor()``, a collective of the stage's ranks), so that Lightning's
``grad_norm(self)`` and a hand clip see one device's tensors; what the hook changes in a copy is written
back into the parameter's shard when the hook ends and before Lightning's clipping. With one stage the view
is on only for such parameters.

Cost: the first call in a hook gathers every stage's parameters and gradients to every rank of the
pipeline (the whole model's size, twice, for the hook's duration); a hook that never asks costs
nothing. Other hooks and the steps see this stage's parameters (``configure_optimizers`` must).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.engine.aux_losses import set_reducer
from lightning_gpipe.partition.cut import key_prefix
from lightning_gpipe.state.dtensors import full_tensors, shard_like
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.groups import close_at_exit, tensors_to_cpu

__all__ = ["WholeParameters", "attach"]

_HOOK_CALLERS = ("post_backward", "_after_closure")  # the precision plugin's calls of the gradient hooks


class WholeParameters:
    """The LightningModule's ``parameters()`` and ``named_parameters()`` as the whole model's, in the
    gradient hooks (module docstring).

    Args:
        pipelined: this rank's stage in the module.
        group: the pipeline's process group (its stages' ranks).
        arrive: ``arrive(operation)``: every rank of the job reaches ``operation`` or it fails naming the
            missing (the strategy's ``_arrive``).
    """

    def __init__(self, pipelined: Pipelined, group: Any, arrive: Callable[[str], None]) -> None:
        self.pipelined, self.group, self.arrive = pipelined, group, arrive
        self._view: list[tuple[str, nn.Parameter]] | None = None
        self._copies: list[tuple[nn.Parameter, nn.Parameter]] = []  # (DTensor parameter, its whole copy)
        self._depth = 0

    def install(self, plugin: Any, module: nn.Module) -> None:
        """Make ``plugin``'s calls of the gradient hooks run inside :meth:`active` for ``module``."""
        self.uninstall(plugin)  # a plugin reused by another fit: its own methods, wrapped once
        for name in _HOOK_CALLERS:
            original = getattr(plugin, name)

            @functools.wraps(original)
            def wrapped(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                with self.active(module):
                    return _original(*args, **kwargs)

            plugin.__dict__[name] = wrapped
        clip = plugin.clip_gradients

        @functools.wraps(clip)
        def clip_gradients(*args: Any, **kwargs: Any) -> Any:
            self._write_back()  # a hand change of the whole copies reaches the shards before the clip
            try:
                return clip(*args, **kwargs)
            finally:
                self._view = None  # the stages' own gradients changed: copies gathered again if asked

        plugin.__dict__["clip_gradients"] = clip_gradients

    @staticmethod
    def uninstall(plugin: Any) -> None:
        """Undo :meth:`install`."""
        for name in (*_HOOK_CALLERS, "clip_gradients"):
            plugin.__dict__.pop(name, None)

    @contextlib.contextmanager
    def active(self, module: nn.Module) -> Iterator[None]:
        """Inside: ``module.parameters()`` and ``module.named_parameters()`` are the whole model's."""
        if self.pipelined.installed is None or (self.pipelined.stages < 2 and not self._dtensors()):
            yield
            return
        self._depth += 1
        if self._depth == 1:
            module.__dict__["named_parameters"] = self._named_parameters
            module.__dict__["parameters"] = self._parameters
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                module.__dict__.pop("named_parameters", None)
                module.__dict__.pop("parameters", None)
                self._write_back()
                self._view = None

    def _named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self._whole():
            yield (f"{prefix}.{name}" if prefix else name), p

    def _parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self._whole():
            yield p

    def _whole(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter of the model by its name, in model order: this stage's own, the others' copies."""
        if self._view is None:
            self.arrive("the whole model's parameters (parameters() in a gradient hook)")
            mine = self._own()
            device = next(iter(self.pipelined.running.parameters()), torch.empty(0)).device  # the copies'
            # a DTensor (sharded or tensor-parallel stage) goes whole: a collective every rank runs
            whole = {n: tensors_to_cpu(full_tensors((p, p.grad))) for n, p in mine.items()}
            payload = {n: (*whole[n], p.requires_grad) for n, p in mine.items()}
            gathered: list[Any] = [payload]
            if self.group is not None and dist.get_world_size(self.group) > 1:
                gathered = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(gathered, payload, group=self.group)
            found: dict[str, nn.Parameter] = {}
            for part in gathered:
                for name, (data, grad, requires_grad) in part.items():
                    if name in mine or name in found:
                        continue
                    copy = nn.Parameter(data.to(device), requires_grad=requires_grad)
                    copy.grad = grad.to(device) if grad is not None else None
                    found[name] = copy
            self._copies = []
            for n, p in mine.items():  # a DTensor of this stage: a whole copy, its changes written back
                if isinstance(p, DTensor):
                    # copied: a Replicate DTensor's full_tensor() is its local tensor
                    copy = nn.Parameter(whole[n][0].to(device, copy=True), requires_grad=p.requires_grad)
                    copy.grad = whole[n][1].to(device, copy=True) if whole[n][1] is not None else None
                    self._copies.append((p, copy))
                    mine[n] = copy
            found.update(mine)
            names = self.pipelined.plain_names or []
            self._view = [(n, found[n]) for n in names if n in found]
        return self._view

    def _dtensors(self) -> bool:
        """Whether this stage holds a ``DTensor`` parameter (tensor-parallel or sharded)."""
        return any(isinstance(p, DTensor) for p in self.pipelined.running.parameters())

    def _write_back(self) -> None:
        """Give each ``DTensor`` parameter of this stage its shard of its whole copy's value and gradient, so
        that what the hook changed in place (a hand clip) changes the parameter, as on one device. Every rank
        of a stage holds the same copies, so the shards agree (no communication)."""
        with torch.no_grad():
            for p, copy in self._copies:
                for target, whole in ((p, copy.detach()), (p.grad, copy.grad)):
                    if isinstance(target, DTensor) and whole is not None:
                        target.to_local().copy_(shard_like(whole, target).to_local())
        self._copies = []

    def over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a stage's aux losses) summed over the pipeline's stages; this process's after fit."""
        if self.pipelined.installed is None or self.group is None:
            return value
        self.arrive("take_aux_losses")
        total = value.to(next(iter(self.pipelined.running.parameters()), value).device)
        dist.all_reduce(total, group=self.group)
        return total.cpu()

    def release_groups(self) -> None:
        """Let go of the pipeline's process group (at exit, and before the ranks connect again)."""
        self.group, self._view = None, None
        set_reducer(None)

    def _own(self) -> dict[str, nn.Parameter]:
        """This stage's parameters by their names in the model (tied copies it does not own left out)."""
        stage, prefix = self.pipelined.running, key_prefix(self.pipelined.name or "")  # a plan's root: ""
        aliases, names = self.pipelined.tied_aliases(), set(self.pipelined.plain_names or [])
        own = ((prefix + n, p) for n, p in stage.named_parameters())
        return {n: p for n, p in own if aliases.get(n) is None and n in names}


def attach(
    plugin: Any, module: nn.Module, pipelined: Pipelined, groups: Any, arrive: Callable[[str], None]
) -> None:
    """Give ``module``'s gradient hooks the whole model's parameters (:class:`WholeParameters`), and
    :func:`lightning_gpipe.engine.aux_losses.take_aux_losses` the sum over the pipeline's stages (``groups``:
    the strategy's :class:`~lightning_gpipe.transport.groups.Groups`, ``None`` without processes). After
    ``fit`` both are inert: the view is the stage's only while it is installed. The view lets go of the
    pipeline's group with the strategy's (:func:`lightning_gpipe.transport.groups.close_at_exit`), so that
    no group outlives ``destroy_process_group`` with its threads."""
    view = WholeParameters(pipelined, groups.pipeline if groups is not None else None, arrive)
    view.install(plugin, module)
    close_at_exit(view)
    set_reducer(view.over_stages if view.group is not None and pipelined.stages > 1 else None)
