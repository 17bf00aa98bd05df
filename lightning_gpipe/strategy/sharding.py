"""Sharded data parallel per stage (issue 42, item 2): each stage's blocks sharded with FSDP2 over the mesh's
data-parallel dimension, gradients reduce-scattered once per step.

With ``GPipeStrategy(data_parallel="fsdp")`` every child of the stage that holds parameters (a block) is
wrapped with :func:`torch.distributed.fsdp.fully_shard` over ``mesh["data_parallel"]``, then the stage
itself, as the root (``torchtitan``'s order: each block gathered and reduced in a collective of its own).
Its parameters become ``DTensor`` shards (dimension 0 over the D replicas of the stage); the
optimizer, built after the cut, holds the shards and their state, so parameters, gradients and optimizer
state per rank are about 1/(K·D) of the model's.

Each micro-batch's backward would reduce-scatter its gradients; only the last backward of each virtual
stage in a step does (:meth:`ShardedStage.before_backward`): the earlier ones accumulate the unsharded
gradients (FSDP2's ``set_requires_gradient_sync(False)``, its ``no_sync``) and keep the gathered
parameters for the next micro-batch (``set_reshard_after_backward(False)``). The reduce-scatter averages
over the replicas, as the replicated mode's all-reduce does, which is skipped. No backward is split into
input and weight gradients (``executor.split_backward``): FSDP2 reduces a block's gradients once its input
gradient is computed, which is also why ``schedule="zb_h1"`` is refused (:func:`check_schedule`).

With ``tensor_parallel_size`` > 1 the user's plan has run on the stage first
(:mod:`lightning_gpipe.strategy.tensor_parallel`), as torchtitan composes them: ``fully_shard`` over
``mesh["data_parallel"]`` meets ``DTensor`` parameters over ``mesh["tensor_parallel"]`` (dimensions of one
mesh, which FSDP2 requires) and shards them again, into 2-D ``DTensor`` parameters over both dimensions; one
the plan left alone is sharded over the data-parallel dimension only.

The stage's forward is not the root's hooked forward: the stage calls its blocks micro-batch by
micro-batch, and non-last stages leave their forward by an exception (``StageDone``), so the root's
forward hooks are removed and its lazy initialization run at wrapping; each block runs as the forward
root of its own calls (FSDP2's path for a submodule run alone).

At teardown :meth:`ShardedStage.unshard` gives every wrapped module its full parameters back as plain
tensors and its own class, and the optimizer those parameters with whole state, so that the user's
Sequential is whole and unwrapped after ``fit`` (and a checkpoint saved then is a plain stage's).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer

from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PartitionError
from lightning_gpipe.state.dtensors import full_tensors

__all__ = ["FSDP", "ShardedStage", "check_schedule", "check_ties", "shard_stage"]

FSDP = "fsdp"


def check_schedule(data_parallel: str, schedule: str) -> None:
    """Refuse what FSDP cannot run, before any process starts.

    Raises:
        ValueError: ``schedule="zb_h1"`` with ``data_parallel="fsdp"``: its split backward computes a
            block's input gradient before its weight gradients, but FSDP2 reduce-scatters a block's
            gradients when its input gradient is computed.
    """
    if data_parallel == FSDP and schedule == "zb_h1":
        raise ValueError(
            "schedule='zb_h1' cannot run with data_parallel='fsdp': zb_h1 computes a block's input "
            "gradient before its weight gradients, and FSDP reduce-scatters a block's gradients as soon as "
            "its input gradient is computed; use schedule='1f1b' or 'interleaved_1f1b' with fsdp, or "
            "data_parallel='replicate' with zb_h1"
        )


def check_ties(seq: nn.Module, data_parallel: str) -> None:
    """Refuse parameters shared by two layers of the pipelined Sequential under ``data_parallel="fsdp"``.

    FSDP shards each block's parameters on its own; a parameter shared by two blocks (a tied embedding
    and head) would be sharded twice. A tie inside one layer is fine.

    Raises:
        PartitionError: a parameter held by two layers, naming both and the fix.
    """
    if data_parallel != FSDP:
        return
    owner: dict[int, str] = {}
    for name, layer in seq.named_children():
        for pname, p in layer.named_parameters():
            first = owner.setdefault(id(p), f"{name}.{pname}")
            if not first.startswith(f"{name}."):
                raise PartitionError(
                    f"data_parallel='fsdp' cannot shard a parameter shared by two layers ({first} is "
                    f"{name}.{pname}): each layer is sharded on its own. Untie them (give the second layer "
                    "its own parameter), or use data_parallel='replicate', which keeps tied parameters "
                    "across stages equal"
                )


def _blocks(stage: nn.Module) -> list[nn.Module]:
    """The stage's children that hold parameters, in order."""
    return [m for m in stage.children() if next(m.parameters(), None) is not None]


def _original_class(module: nn.Module) -> type:
    """The class ``fully_shard`` swapped out of ``module`` (the first base that is not ``FSDPModule``)."""
    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


class ShardedStage:
    """One rank's stage, its blocks and itself wrapped with FSDP2 over the stage's data-parallel group.

    Args:
        stage: this rank's stage (its children are the blocks; virtual stages name theirs).
        mesh: the data-parallel dimension of the strategy's mesh (``mesh["data_parallel"]``).
    """

    def __init__(self, stage: PipelineStage, mesh: Any) -> None:
        # the last stage's outputs reach the user detached (PipelineStage.forward): an in-place op on them
        # cannot drop FSDP's pre-backward hook, which FSDP warns of for every view a block returns
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        self.stage = stage
        names = {id(m): n for n, m in stage.named_children()}
        self.blocks = _blocks(stage)
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(stage, mesh=mesh)
        root = stage._get_fsdp_state()  # type: ignore[operator]
        root._pre_forward_hook_handle.remove()  # the stage's calls are not one forward (module docs)
        root._post_forward_hook_handle.remove()
        root._lazy_init()
        # each virtual stage's blocks, whose last backward of a step reduce-scatters
        self.virtual = [
            [b for b in self.blocks if names[id(b)] in set(layers)] for layers in stage.virtual_layers
        ]
        self.optimizers: list[Optimizer] = []  # set once built: made whole with the stage (unshard)
        stage.executor.before_backward = self.before_backward
        stage.executor.split_backward = False  # input gradients first would reduce-scatter early

    def before_backward(self, virtual_stage: int, last: bool) -> None:
        """Before a micro-batch's backward through ``virtual_stage``'s blocks: gradients reduce-scattered and
        parameters resharded only when it is the ``last`` of the step's backwards there."""
        for block in self.virtual[virtual_stage]:
            block.set_requires_gradient_sync(last, recurse=False)  # type: ignore[operator]
            block.set_reshard_after_backward(last, recurse=False)  # type: ignore[operator]

    def unshard(self) -> None:
        """Give every wrapped module its full parameters as plain tensors, its hooks and class removed, and
        :attr:`optimizers` those parameters with their state whole (a checkpoint saved after ``fit`` is a
        plain stage's).

        A collective over the stage's data-parallel group (each ``DTensor.full_tensor()`` all-gathers).
        """
        self.stage.executor.before_backward, self.stage.executor.split_backward = None, True
        whole: dict[nn.Parameter, nn.Parameter] = {}
        for module in [*self.blocks, self.stage]:
            state = module._get_fsdp_state()  # type: ignore[operator]
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    sharded, info = fsdp_param.sharded_param, fsdp_param._module_info
                    full = nn.Parameter(full_tensors(sharded).detach(), requires_grad=sharded.requires_grad)
                    info.module._parameters[info.param_name] = whole[sharded] = full
                    fsdp_param._post_load_hook_handle.remove()
                hooks = [
                    group._module_to_pre_save_state_dict_hook_handle,
                    group._module_to_pre_load_state_dict_hook_handle,
                ]
                for handle in [h for handles in hooks for h in handles.values()]:
                    handle.remove()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            for key in [k for k in module.__dict__ if k.startswith("__composable_api_")]:
                del module.__dict__[key]
            _module_state_mapping.pop(module, None)  # fully_shard may wrap it again (a later fit)
            module.__class__ = _original_class(module)
        for optimizer in self.optimizers:
            _swap_parameters(optimizer, whole)


def _swap_parameters(optimizer: Optimizer, whole: dict[nn.Parameter, nn.Parameter]) -> None:
    """``optimizer`` over the ``whole`` parameters in place of their shards, its state made whole too."""
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                state[whole.get(p, p)] = full_tensors(dict(optimizer.state[p]))
        group["params"] = [whole.get(p, p) for p in group["params"]]
    optimizer.state.clear()
    optimizer.state.update(state)


def shard_stage(stage: PipelineStage, mesh: Any, data_parallel: str) -> ShardedStage | None:
    """Wrap ``stage`` with FSDP2 over ``mesh["data_parallel"]`` when ``data_parallel="fsdp"``
    (:class:`ShardedStage`); ``None`` otherwise or without a mesh (one process)."""
    if data_parallel != FSDP or mesh is None:
        return None
    return ShardedStage(stage, mesh["data_parallel"])
