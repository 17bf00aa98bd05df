"""Optimizer states merged from every stage into one over the whole model, and split back.

Each stage's optimizer holds only that stage's parameters. A merged optimizer ``state_dict`` is
what one optimizer over the whole Sequential would hold when its parameter groups list the
parameters in model order (what ``configure_optimizers`` over ``self.parameters()`` gives): for
each group, stage 0's parameters, then stage 1's, and so on, numbered from 0 across groups as
``torch.optim`` numbers them. The merged dict also keeps the parameter names under
:data:`NAMES_KEY`, so it can be split again for any number of stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_gpipe.partition import PLACEHOLDER

__all__ = [
    "NAMES_KEY",
    "CheckpointError",
    "drop_placeholder",
    "drop_placeholder_names",
    "group_names",
    "merge_optimizer_states",
    "split_optimizer_state",
    "tensors_to_cpu",
]

NAMES_KEY = "gpipe_param_names"


class CheckpointError(ValueError):
    """A checkpoint does not fit the module or optimizer it is loaded into."""


def group_names(optimizer: Optimizer, names_by_id: Mapping[int, str], missing: str = "?") -> list[list[str]]:
    """Parameter names of each of ``optimizer``'s groups, in the optimizer's order (``missing`` if unknown)."""
    return [[names_by_id.get(id(p), missing) for p in group["params"]] for group in optimizer.param_groups]


def merge_optimizer_states(parts: Sequence[tuple[dict[str, Any], list[list[str]]]]) -> dict[str, Any]:
    """Merge per-stage optimizer ``state_dict``s (in stage order) into one over the whole model.

    Args:
        parts: ``(state_dict, names per group)`` of every stage, stage 0 first.

    Raises:
        CheckpointError: the stages disagree on the number of parameter groups.
    """
    groups = {len(sd["param_groups"]) for sd, _ in parts}
    if len(groups) != 1:
        raise CheckpointError(
            f"stages have different numbers of optimizer parameter groups: {sorted(groups)}"
        )
    merged_state: dict[int, Any] = {}
    merged_groups: list[dict[str, Any]] = []
    names: list[str] = []
    for g in range(groups.pop()):
        first = parts[0][0]["param_groups"][g]
        group = {k: v for k, v in first.items() if k != "params"}
        group["params"] = []
        for sd, part_names in parts:
            for local, name in zip(sd["param_groups"][g]["params"], part_names[g]):
                index = len(names)
                names.append(name)
                group["params"].append(index)
                if local in sd["state"]:
                    merged_state[index] = sd["state"][local]
        merged_groups.append(group)
    return {"state": merged_state, "param_groups": merged_groups, NAMES_KEY: names}


def split_optimizer_state(
    merged: Mapping[str, Any],
    local_names: list[list[str]],
    stateless: Callable[[str], bool] = lambda name: False,
) -> dict[str, Any]:
    """This stage's ``state_dict`` out of a merged one, matching parameters by name.

    Args:
        merged: a merged optimizer ``state_dict`` (with :data:`NAMES_KEY`), or a plain one-device
            one whose single group lists every parameter in model order.
        local_names: this stage's optimizer's parameter names per group.
        stateless: names of parameters that are not in checkpoints (they get no state).

    Raises:
        CheckpointError: a parameter of this stage is missing from the checkpoint, or the group
            structure differs.
    """
    names = merged.get(NAMES_KEY)
    if names is None:
        raise CheckpointError(
            "the optimizer state in this checkpoint has no parameter names (it was not written by the "
            "gpipe strategy); load it with the same strategy that saved it, or with weights only"
        )
    if len(merged["param_groups"]) != len(local_names):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(merged['param_groups'])} parameter groups, this one "
            f"{len(local_names)}; configure_optimizers must build the same groups"
        )
    index = {name: k for k, name in enumerate(names)}
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    local = 0
    for g, group_names_ in enumerate(local_names):
        group = {k: v for k, v in merged["param_groups"][g].items() if k != "params"}
        group["params"] = []
        for name in group_names_:
            if stateless(name):
                group["params"].append(local)
                local += 1
                continue
            if name not in index:
                raise CheckpointError(f"parameter {name!r} has no optimizer state in the checkpoint")
            if index[name] in merged["state"]:
                state[local] = merged["state"][index[name]]
            group["params"].append(local)
            local += 1
        groups.append(group)
    return {"state": state, "param_groups": groups}


def tensors_to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested dict/list to CPU (for gathering with object collectives)."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to_cpu(v) for v in obj)
    return obj


def drop_placeholder_names(names: list[list[str]]) -> list[list[str]]:
    return [[n for n in group if PLACEHOLDER not in n] for group in names]


def drop_placeholder(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Remove the placeholder parameter from a stage's optimizer ``state_dict``."""
    groups = []
    for group, group_names_ in zip(state["param_groups"], names):
        keep = [i for i, n in zip(group["params"], group_names_) if PLACEHOLDER not in n]
        groups.append({**group, "params": keep})
    return {"state": state["state"], "param_groups": groups}
