"""Sharded data parallel per stage (issue 42, items 2 and 4): each stage's blocks sharded with FSDP2 over the
mesh's data-parallel dimension, gradients reduce-scattered once per step, under every schedule.

With ``GPipeStrategy(data_parallel="fsdp")`` every child of the stage that holds parameters (a block) is
wrapped with :func:`torch.distributed.fsdp.fully_shard` over ``mesh["data_parallel"]`` (blocks sharing a
parameter together), then the stage itself, as the root (``torchtitan``'s order: each block gathered and
reduced in a collective of its own).
Its parameters become ``DTensor`` shards (dimension 0 over the D replicas of the stage); the
optimizer, built after the cut, holds the shards and their state, so parameters, gradients and optimizer
state per rank are about 1/(K·D) of the model's.

Each micro-batch's backward would reduce-scatter its gradients; only the last backward of each virtual
stage in a step does (:meth:`ShardedStage.before_backward`): the earlier ones accumulate the unsharded
gradients (FSDP2's ``set_requires_gradient_sync(False)``, its ``no_sync``) and keep the gathered
parameters for the next micro-batch (``set_reshard_after_backward(False)``). The reduce-scatter averages
over the replicas, as the replicated mode's all-reduce does, which is skipped. These schedules run no
backward split into input and weight gradients (``executor.split_backward``): FSDP2 reduces a block's
gradients once its input gradient is computed.

``schedule="zb_h1"`` splits every backward (``B`` the input gradient, ``W`` the weight gradients later,
:mod:`lightning_gpipe.engine.backward_split`), so no backward reduces (``split=True``): every ``B`` and
``W`` accumulates into the unsharded gradients, and once the step's column has run its last ``W``
(``PipelineStage.after_backward``) :meth:`ShardedStage.reduce` reduce-scatters each block's gradients
itself, as ``torch.distributed.pipelining`` does for its zero-bubble schedules with FSDP
(``_PipelineStageBase.perform_reduce_grad``): FSDP2's ``post_backward`` of each parameter group with
the reduction on, then its root's final callback. A ``W`` runs on the parameters its ``B`` gathered, after
forwards of later micro-batches: from a virtual stage's first ``B`` of a step to the reduce its blocks
stay gathered (``set_reshard_after_forward(False)``; torchtitan keeps them gathered through the whole
step under pipeline parallelism), sharded again after it.

A parameter tied across stages (GPT-2's embedding and LM head, :mod:`lightning_gpipe.partition.tied`) is a
separate parameter on each stage holding it, sharded there on its own; with the same shape on every stage
each replica holds the same rows of every copy, so the tied gradients are summed over the stages holding
them shard by shard (``sum_tied_gradients`` on the local shards, after the reduce-scatter), as under
``"replicate"``. Blocks of one stage that share a parameter are wrapped together, as one FSDP2 group
(``fully_shard([a, b])``, the parameter sharded once); in two virtual stages of one stage they are refused
(:func:`check_ties`).

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

from lightning_gpipe._compat import children
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.errors import PartitionError
from lightning_gpipe.state.dtensors import full_tensors
from lightning_gpipe.transport.layout import layer_parts, layer_stages

__all__ = ["FSDP", "ShardedStage", "check_ties", "shard_stage"]

FSDP = "fsdp"


def check_ties(seq: nn.Module, data_parallel: str, balance: Any, stages: int) -> None:
    """Refuse, under ``data_parallel="fsdp"``, a parameter shared by layers in two virtual stages of one
    stage.

    Layers on different stages hold separate copies, each sharded on its own and kept equal
    (:mod:`lightning_gpipe.partition.tied`); layers of one part (one stage, or one virtual stage) that share
    a parameter are wrapped as one FSDP2 group (``fully_shard([a, b])``). Such a group runs its forward
    as one pass over its modules (its post-backward hook registered at the first module's input, its
    pre-backward hook at the last one's output); two virtual stages of a stage interleave other
    micro-batches between the two layers, so the group would lose its hooks.

    Args:
        balance: layers per part (K·v entries with virtual stages); anything else (a balancer's name,
            ``None``) checks nothing: the strategy checks again once the balance is chosen.
        stages: the pipeline stages K.

    Raises:
        PartitionError: a parameter held by layers in two parts of one stage, naming both, the stage and
            the fix.
    """
    if data_parallel != FSDP or not isinstance(balance, list):
        return
    stage_of, part_of = layer_stages(balance, stages), layer_parts(balance)
    owner: dict[int, tuple[int, str]] = {}
    for k, (name, layer) in enumerate(children(seq).items()):
        for pname, p in layer.named_parameters():
            first, first_name = owner.setdefault(id(p), (k, f"{name}.{pname}"))
            if stage_of[first] == stage_of[k] and part_of[first] != part_of[k]:
                parts = f"parts {part_of[first]} and {part_of[k]}, both on stage {stage_of[k]}"
                raise PartitionError(
                    "data_parallel='fsdp' cannot shard a parameter shared by two virtual stages of one "
                    f"stage ({first_name} is {name}.{pname}: {parts} with balance {balance}): FSDP shards "
                    "the layers sharing it as one group, whose forward cannot interleave with other "
                    "micro-batches. Choose a balance that puts the two layers in one part or on different "
                    "stages, give the second layer its own parameter, or use data_parallel='replicate'"
                )


def _blocks(stage: nn.Module) -> list[nn.Module]:
    """The stage's children that hold parameters, in order."""
    return [m for m in stage.children() if next(m.parameters(), None) is not None]


def _tie_groups(blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """``blocks`` in groups that share no parameter with one another (blocks sharing one, a tie inside the
    stage, in one group), each in stage order, ordered by their first block."""
    group_of = list(range(len(blocks)))  # each block's group: the first block it is tied to, transitively
    seen: dict[int, int] = {}  # parameter id -> the first block holding it
    for k, block in enumerate(blocks):
        for p in block.parameters():
            first = group_of[seen.setdefault(id(p), k)]
            if first != group_of[k]:
                merged = group_of[k]
                group_of = [first if g == merged else g for g in group_of]
    groups: dict[int, list[nn.Module]] = {}
    for k, block in enumerate(blocks):
        groups.setdefault(group_of[k], []).append(block)
    return list(groups.values())


def _original_class(module: nn.Module) -> type:
    """The class ``fully_shard`` swapped out of ``module`` (the first base that is not ``FSDPModule``)."""
    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


class ShardedStage:
    """One rank's stage, its blocks and itself wrapped with FSDP2 over the stage's data-parallel group.

    Args:
        stage: this rank's stage (its children are the blocks; virtual stages name theirs).
        mesh: the data-parallel dimension of the strategy's mesh (``mesh["data_parallel"]``).
        split: the schedule splits backwards into input and weight gradients (``zb_h1``): no backward
            reduces, :meth:`reduce` does once the step's column has run (module docstring).
    """

    def __init__(self, stage: PipelineStage, mesh: Any, split: bool = False) -> None:
        # the last stage's outputs reach the user detached (PipelineStage.forward): an in-place op on them
        # cannot drop FSDP's pre-backward hook, which FSDP warns of for every view a block returns
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        self.stage, self.split = stage, split
        names = {id(m): n for n, m in stage.named_children()}
        self.blocks = _blocks(stage)
        for group in _tie_groups(self.blocks):  # blocks sharing a parameter: one FSDP2 group
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
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
        stage.executor.split_backward = split  # unsplit, input gradients first would reduce-scatter early
        if split:
            stage.after_backward = self.reduce
            self._reduce_on(False)

    def before_backward(self, virtual_stage: int, last: bool) -> None:
        """Before a micro-batch's backward through ``virtual_stage``'s blocks: gradients reduce-scattered and
        parameters resharded only when it is the ``last`` of the step's backwards there.

        With ``split`` nothing reduces; the blocks are gathered (an all-gather over the data-parallel group
        where they are sharded), so that the backward is split over the parameters the forward used, and stay
        gathered through later forwards until :meth:`reduce`, for the ``W`` that follows."""
        for block in self.virtual[virtual_stage]:
            if self.split:
                block.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
                block.unshard()  # type: ignore[operator]
            else:
                block.set_requires_gradient_sync(last, recurse=False)  # type: ignore[operator]
                block.set_reshard_after_backward(last, recurse=False)  # type: ignore[operator]

    def _reduce_on(self, on: bool) -> None:
        """Every block's gradients reduce-scattered and parameters resharded at its post-backward, or not."""
        for block in self.blocks:
            block.set_requires_gradient_sync(on, recurse=False)  # type: ignore[operator]
            block.set_reshard_after_backward(on, recurse=False)  # type: ignore[operator]

    def reduce(self) -> None:
        """With ``split``, after a training step's column (its last ``W``): every block's accumulated
        gradients reduce-scattered into its sharded gradients and its parameters resharded (FSDP2's
        ``post_backward`` of each parameter group, then its root's final callback, as
        ``torch.distributed.pipelining``'s ``perform_reduce_grad``). A collective over the data-parallel
        group, in the same block order on every replica."""
        self._reduce_on(True)
        for block in self.blocks:
            block.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
        for state in reversed(self._states()[:-1]):  # the blocks' (the root holds none), backward's order
            for group in state._fsdp_param_groups:
                group.post_backward()
        self.stage._get_fsdp_state()._root_post_backward_final_callback()  # type: ignore[operator]
        self._reduce_on(False)

    def _states(self) -> list[Any]:
        """The FSDP2 states of the blocks (one for blocks wrapped together), then the stage's, in order."""
        states = [m._get_fsdp_state() for m in [*self.blocks, self.stage]]  # type: ignore[operator]
        return list({id(state): state for state in states}.values())

    def unshard(self) -> None:
        """Give every wrapped module its full parameters as plain tensors, its hooks and class removed, and
        :attr:`optimizers` those parameters with their state whole (a checkpoint saved after ``fit`` is a
        plain stage's).

        A collective over the stage's data-parallel group (each ``DTensor.full_tensor()`` all-gathers).
        """
        self.stage.executor.before_backward, self.stage.executor.split_backward = None, True
        self.stage.after_backward = None
        whole: dict[nn.Parameter, nn.Parameter] = {}
        for state in self._states():
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    sharded, info = fsdp_param.sharded_param, fsdp_param._module_info
                    full = nn.Parameter(full_tensors(sharded).detach(), requires_grad=sharded.requires_grad)
                    whole[sharded] = full
                    places = [(info.module, info.param_name)]
                    places += list(zip(info.shared_modules, info.shared_param_names))  # a tie within a group
                    for owner, name in places:
                        owner._parameters[name] = full
                    fsdp_param._post_load_hook_handle.remove()
                hooks = [
                    group._module_to_pre_save_state_dict_hook_handle,
                    group._module_to_pre_load_state_dict_hook_handle,
                ]
                for handle in [h for handles in hooks for h in handles.values()]:
                    handle.remove()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        for module in [*self.blocks, self.stage]:
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


def shard_stage(
    stage: PipelineStage, mesh: Any, data_parallel: str, schedule: str = "1f1b"
) -> ShardedStage | None:
    """Wrap ``stage`` with FSDP2 over ``mesh["data_parallel"]`` when ``data_parallel="fsdp"``
    (:class:`ShardedStage`, its backwards split under ``schedule="zb_h1"``); ``None`` otherwise or without a
    mesh (one process)."""
    if data_parallel != FSDP or mesh is None:
        return None
    return ShardedStage(stage, mesh["data_parallel"], split=schedule == "zb_h1")
