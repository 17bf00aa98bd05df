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

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gpipe.errors import CheckpointError
from lightning_gpipe.partition.cut import PLACEHOLDER

__all__ = [
    "NAMES_KEY",
    "CheckpointError",
    "drop_placeholder",
    "drop_placeholder_names",
    "group_names",
    "merge_optimizer_states",
    "split_optimizer_state",
]

NAMES_KEY = "gpipe_param_names"


def group_names(optimizer: Optimizer, names_by_id: Mapping[int, str], missing: str = "?") -> list[list[str]]:
    """Parameter names of each of ``optimizer``'s groups, in the optimizer's order (``missing`` if
    unknown)."""
    return [[names_by_id.get(id(p), missing) for p in group["params"]] for group in optimizer.param_groups]


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _same_hyper(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def merge_optimizer_states(
    parts: Sequence[tuple[dict[str, Any], list[list[str]]]], order: Sequence[str] | None = None
) -> dict[str, Any]:
    """Merge per-stage optimizer ``state_dict``s into one over the whole model.

    Groups are matched by hyper-parameters (every key but ``params``), never by position: the
    k-th group of equal hyper-parameters on each stage is one group of the merged optimizer, and a
    group may be missing on a stage (a stage that holds none of its parameters). When every stage
    lists the same groups in the same order (an explicit list, groups possibly empty on a stage),
    the merged groups keep that order; otherwise they are ordered by their first parameter in model
    order (``order``; groups without parameters last), which is what ``configure_optimizers`` builds
    on one device when it makes groups as it iterates ``named_parameters()``. Parameters within a
    group are in model order.

    Args:
        parts: ``(state_dict, names per group)`` of every stage, stage 0 first.
        order: every parameter name of the whole model, in model order (default: the stages' order).
    """
    rank_of = {name: k for k, name in enumerate(order)} if order is not None else {}
    groups: list[tuple[dict[str, Any], list[tuple[str, Any]]]] = []  # (hyper, [(name, state)])
    for sd, part_names in parts:
        used: list[int] = []
        for group, group_names_ in zip(sd["param_groups"], part_names):
            hyper = _hyper(group)
            match = next(
                (j for j, (h, _) in enumerate(groups) if j not in used and _same_hyper(h, hyper)), None
            )
            if match is None:
                groups.append((hyper, []))
                match = len(groups) - 1
            used.append(match)
            for local, name in zip(group["params"], group_names_):
                rank_of.setdefault(name, len(rank_of))
                groups[match][1].append((name, sd["state"].get(local)))
    hypers = [[_hyper(g) for g in sd["param_groups"]] for sd, _ in parts]
    listed_alike = all(
        len(h) == len(hypers[0]) and all(_same_hyper(a, b) for a, b in zip(h, hypers[0])) for h in hypers
    )
    if not listed_alike:  # e.g. groups made in the order their parameters first occur on each stage
        big = len(rank_of) + len(groups)
        groups.sort(key=lambda g: min((rank_of[n] for n, _ in g[1]), default=big))
    merged_state: dict[int, Any] = {}
    merged_groups: list[dict[str, Any]] = []
    names: list[str] = []
    for hyper, members in groups:
        group = dict(hyper, params=[])
        for name, state in sorted(members, key=lambda m: rank_of[m[0]]):
            index = len(names)
            names.append(name)
            group["params"].append(index)
            if state is not None:
                merged_state[index] = state
        merged_groups.append(group)
    return {"state": merged_state, "param_groups": merged_groups, NAMES_KEY: names}


def split_optimizer_state(
    merged: Mapping[str, Any],
    local_names: list[list[str]],
    stateless: Callable[[str], bool] = lambda name: False,
    local_groups: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """This stage's ``state_dict`` out of a merged one, matching parameters and groups by name.

    Each local group takes the hyper-parameters of the merged group that holds its parameters;
    a local group without parameters of the checkpoint keeps its own (``local_groups``), or takes
    those of a merged group with the same keys.

    Args:
        merged: a merged optimizer ``state_dict`` (with :data:`NAMES_KEY`).
        local_names: this stage's optimizer's parameter names per group.
        stateless: names of parameters that are not in checkpoints (they get no state).
        local_groups: this stage's optimizer's ``param_groups`` (for groups with no saved parameter).

    Raises:
        CheckpointError: a parameter of this stage is missing from the checkpoint, or one local
            group's parameters are spread over several groups of the checkpoint.
    """
    names = merged.get(NAMES_KEY)
    if names is None:
        raise CheckpointError(
            "the optimizer state in this checkpoint has no parameter names (it was not written by the "
            "gpipe strategy); load it with the same strategy that saved it, or with weights only"
        )
    index = {name: k for k, name in enumerate(names)}
    group_of = {p: g for g, group in enumerate(merged["param_groups"]) for p in group["params"]}
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    local = 0
    for g, group_names_ in enumerate(local_names):
        saved = {group_of[index[n]] for n in group_names_ if not stateless(n) and n in index}
        if len(saved) > 1:
            raise CheckpointError(
                f"parameters of this optimizer's group {g} ({', '.join(group_names_)}) are in {len(saved)} "
                "different groups of the checkpoint; configure_optimizers must build the same groups"
            )
        if saved:
            hyper = _hyper(merged["param_groups"][saved.pop()])
        elif local_groups is not None:
            hyper = _hyper(local_groups[g])
        else:
            hyper = _hyper(merged["param_groups"][min(g, len(merged["param_groups"]) - 1)])
        group = dict(hyper, params=[])
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


def drop_placeholder_names(names: list[list[str]]) -> list[list[str]]:
    return [[n for n in group if PLACEHOLDER not in n] for group in names]


def drop_placeholder(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Remove the placeholder parameter from a stage's optimizer ``state_dict``."""
    groups = []
    for group, group_names_ in zip(state["param_groups"], names):
        keep = [i for i, n in zip(group["params"], group_names_) if PLACEHOLDER not in n]
        groups.append({**group, "params": keep})
    return {"state": state["state"], "param_groups": groups}
