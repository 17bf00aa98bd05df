"""A model that is not one ``nn.Sequential``, pipelined by naming its parts in call order (issue 39).

``GPipeStrategy(plan=["embed", "blocks", "norm", "head"])`` names attributes of the module whose
``forward`` is the chain ``head(norm(blocks[-1](…blocks[0](embed(x)))))``: the LightningModule itself, or
the one submodule that has them all (``module_name=`` chooses). An ``nn.ModuleList`` or ``nn.ModuleDict``
stands for its items in order. The dict form ``{name: (inputs, outputs)}`` (the transformers
``_pp_plan`` format) names the tensors a part takes and gives: a part with several inputs is called with
them positionally in the listed order (:class:`~lightning_gpipe.partition.part_call.PartCall`); a name
the chain takes from outside is the forward's argument of that name.

The parts become a :class:`~lightning_gpipe.partition.plan_chain.PlanChain`: layers named as in the
root (``blocks.3``), cut and balanced like a Sequential's. Installed (:func:`install`), the root holds
only this stage's layers, under their own names, so ``state_dict()``, checkpoints and optimizer names
are the model's (as torchtitan's FQN pruning keeps them); the root's ``forward`` is replaced by the stage
(:class:`~lightning_gpipe.partition.plan_forward.PlanForward`), whose first call checks the user's
forward against the chain with stand-ins for the parts (:func:`check_forward`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import children
from lightning_gpipe.engine.batchnorm import defer_batch_norms, restore_batch_norms
from lightning_gpipe.errors import PartitionError
from lightning_gpipe.partition import cut
from lightning_gpipe.partition.cut import PLACEHOLDER, Installed, check_cut
from lightning_gpipe.partition.plan_chain import PlanChain, Step
from lightning_gpipe.partition.stage_items import StageItems, part_elsewhere

__all__ = [
    "add_placeholder_parameter",
    "check_model",
    "check_plan",
    "find_root",
    "install",
    "uninstall",
    "whole",
]

FIX = "docs/models.md shows how to turn a forward into a chain"


def check_plan(plan: Any) -> list[Step] | None:
    """``GPipeStrategy(plan=...)`` as ``(part, inputs, outputs)`` steps (``None`` stays ``None``).

    Raises:
        ValueError: not a list of names nor a dict ``{name: (inputs, outputs)}``, empty, a name listed
            twice, or a dotted name.
    """
    if plan is None:
        return None
    usage = 'plan=["embed", "blocks", "norm", "head"] or {"embed": (["x"], ["h"]), ...}'
    if isinstance(plan, Mapping):
        steps: list[Step] = []
        for name, io in plan.items():
            if not (isinstance(io, (tuple, list)) and len(io) == 2 and all(_names(v) for v in io)):
                raise ValueError(
                    f"plan[{name!r}] is {io!r}; a dict plan maps each part to (inputs, outputs), lists of "
                    f'tensor names, e.g. {{{name!r}: (["hidden_states"], ["hidden_states"])}}'
                )
            steps.append((name, list(io[0]), list(io[1])))
    elif isinstance(plan, (list, tuple)):
        steps = [(name, None, None) for name in plan]
    else:
        raise ValueError(f"plan must name the model's parts in call order (plan: {plan!r}); e.g. {usage}")
    names = [name for name, _, _ in steps]
    bad = [n for n in names if not isinstance(n, str) or not n or "." in n]
    if not names or bad:
        raise ValueError(
            f"plan names {bad or 'nothing'}; give attribute names of one module (no dots: for parts of "
            f"a submodule, pass module_name= with that submodule's path), e.g. {usage}"
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"plan lists {', '.join(map(repr, twice))} more than once (plan: {names}); name each part once, "
            "in call order (an nn.ModuleList stands for all of its items)"
        )
    return steps


def _names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value)


def find_root(model: nn.Module, steps: Sequence[Step], module_name: str | None) -> tuple[str, nn.Module]:
    """The module whose attributes the plan names: ``module_name``'s, else the LightningModule if it has
    them all, else the one submodule that has them all.

    Raises:
        PartitionError: a name is not a submodule there (the message lists the submodules there is),
            or several submodules have them all.
    """
    wanted = [name for name, _, _ in steps]
    if module_name is not None:
        try:
            root = model.get_submodule(module_name)
        except AttributeError as err:
            raise PartitionError(
                f"module_name={module_name!r} does not name a submodule of {type(model).__name__}"
            ) from err
        return module_name, _check_parts(root, module_name, wanted)
    found = [(n, m) for n, m in model.named_modules() if all(w in children(m) for w in wanted)]
    if len(found) > 1:
        where = ", ".join(repr(n) for n, _ in found)
        raise PartitionError(
            f"several submodules have every part of plan={wanted} ({where}); pass module_name="
        )
    name, root = found[0] if found else ("", model)
    return name, _check_parts(root, name, wanted)


def _check_parts(root: nn.Module, name: str, wanted: list[str]) -> nn.Module:
    owner = f"{type(root).__name__}" + (f" (module_name={name!r})" if name else "")
    have = ", ".join(children(root)) or "none"
    for part in wanted:
        module = children(root).get(part)
        if module is None:
            raise PartitionError(
                f"plan names {part!r}, which is not a submodule of {owner}; its submodules are: {have}. "
                "Name the attributes its forward calls, in call order"
            )
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) == 0:
            raise PartitionError(f"plan names {part!r}, an empty {type(module).__name__} of {owner}")
    return root


def check_model(
    model: Any, plan: Sequence[Step], module_name: str | None, balance: Any, stages: int, v: int
) -> tuple[str, PlanChain, list[int]]:
    """The plan's chain in ``model`` and the balance to cut it with (as :func:`.cut.check_model` for a
    Sequential), before any process starts.

    Raises:
        PartitionError: a name that is not a part (:func:`find_root`); parameters or persistent buffers
            of the model outside the plan; a dict plan's input that neither the forward's arguments nor an
            earlier part gives; a balance that does not fit the layers.
    """
    name, root = find_root(model, plan, module_name)
    chain = PlanChain(root, name, plan)
    _check_everything_inside(model, chain)
    if chain.entry is not None:
        _check_entry(root, chain)
    return check_cut(model, name, chain, balance, stages, v)


def _check_everything_inside(model: nn.Module, chain: PlanChain) -> None:
    inside = {id(t) for t in [*chain.parameters(), *chain.buffers()]}
    state = model.state_dict(keep_vars=True)
    outside = [n for n, t in [*model.named_parameters(), *state.items()] if id(t) not in inside]
    if outside:
        shown = ", ".join(dict.fromkeys(outside[:5])) + (", ..." if len(outside) > 5 else "")
        raise PartitionError(
            f"parameters or buffers outside plan={chain.parts}: {shown}; the pipeline holds only the plan's "
            "parts: add the module holding them to plan= in call order, or move it into a part (a module "
            f"that adds the position embedding to the token embedding, for example; {FIX})"
        )


def _check_entry(root: nn.Module, chain: PlanChain) -> None:
    params = inspect.signature(type(root).forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [n for n in chain.entry or () if n not in params]
    if missing:
        raise PartitionError(
            f"plan takes {', '.join(map(repr, missing))}, which no part gives before and "
            f"{type(root).__name__}.forward has no argument of that name (its arguments: "
            f"{', '.join(list(params)[1:])}); a dict plan's inputs are the forward's arguments or earlier "
            "parts' outputs, by name"
        )


def install(chain: PlanChain, stage: nn.Module, forward: Any, deferred_batch_norm: bool = False) -> Installed:
    """The root holds only ``stage``'s layers, under their own names, in place of the plan's parts, and
    ``forward`` in place of its own; undo with :func:`uninstall`.

    A ``ModuleList``/``ModuleDict`` part becomes a :class:`~.stage_items.StageItems` holding this stage's
    items under their keys (``blocks.3`` stays ``blocks.3``), a part held elsewhere an empty one, so
    ``state_dict()`` and ``load_state_dict(strict=True)`` of the model see exactly this stage's tensors
    by their names, and a step that uses a part directly gets an error that says to call the model.
    """
    root = chain.root
    batch_norms = defer_batch_norms(stage) if deferred_batch_norm else []
    chain.original = dict(children(root))
    held = children(stage)
    staged: dict[str, Any] = {}
    root_call = f"self.{chain.root_name}" if chain.root_name else "self"
    for key, module in chain.original.items():
        if key not in chain.parts:
            staged[key] = module
        elif key in held:
            staged[key] = held[key]
        else:  # this stage's items of a ModuleList/ModuleDict part, or none
            items = {n.split(".", 1)[1]: held[n] for n in held if chain.layer_parts[n] == key}
            stage_index = getattr(getattr(stage, "topology", None), "stage", 0)
            staged[key] = StageItems(items, part_elsewhere(root_call, key, stage_index))
    _set_children(root, staged)
    root.__dict__["forward"] = forward
    return Installed(chain.root_name, root, "", chain, batch_norms)


def uninstall(installed: Installed, state: dict[str, Any] | None = None) -> PlanChain:
    """The root's parts and forward back, loaded with ``state`` (the root's keys, every part's) if given."""
    chain = installed.sequential
    assert isinstance(chain, PlanChain) and chain.original is not None
    restore_batch_norms(installed.batch_norms)
    _set_children(chain.root, chain.original)
    chain.root.__dict__.pop("forward", None)
    chain.original = None
    if state is not None:
        chain.root.load_state_dict(state)
    return chain


def add_placeholder_parameter(installed: Installed, device: torch.device) -> None:
    """A stage without trainable parameters (a reshaping part alone, or all frozen) gives the plan's root
    an empty one, as :func:`.cut.add_placeholder_parameter` gives a Sequential's stage, so that
    ``configure_optimizers`` over ``self.parameters()`` builds there too.

    It is held by a submodule ``_gpipe_placeholder`` of the root, which never reaches a ``state_dict``,
    a checkpoint or a merged optimizer state, and goes with the stage at :func:`uninstall`.
    """
    chain = installed.sequential
    assert isinstance(chain, PlanChain)
    if any(p.requires_grad for p in chain.root.parameters()):
        return
    holder = nn.Module()
    cut.add_placeholder_parameter(holder, device)
    children(chain.root)[PLACEHOLDER] = holder


@contextlib.contextmanager
def whole(installed: Installed) -> Iterator[None]:
    """The root holds every part inside this context, only the stage's layers after it."""
    chain = installed.sequential
    assert isinstance(chain, PlanChain) and chain.original is not None
    staged = dict(children(chain.root))
    _set_children(chain.root, chain.original)
    try:
        yield
    finally:
        _set_children(chain.root, staged)


def _set_children(module: nn.Module, modules: Mapping[str, Any]) -> None:
    held = children(module)
    held.clear()
    held.update(modules)
