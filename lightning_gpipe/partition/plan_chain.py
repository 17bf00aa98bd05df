"""A plan's parts as one chain of layers under the model's own names (``embed``, ``blocks.0``, …)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_gpipe._compat import children
from lightning_gpipe.partition.part_call import PartCall

__all__ = ["PlanChain", "Step"]

Step = tuple[str, "list[str] | None", "list[str] | None"]  # (part, inputs, outputs); None: a list plan


class PlanChain(nn.Sequential):
    """The layers a plan names, in call order, each under its name in the plan's root module.

    A part that is an ``nn.ModuleList`` or ``nn.ModuleDict`` stands for its items in order
    (``blocks.0``, ``blocks.1``, …: one layer each, so a balance counts blocks). The names are dotted,
    so the chain's ``state_dict`` keys are the root's own (``blocks.3.attn.qkv.weight``); the chain is
    cut, balanced, gathered and loaded as the pipelined ``nn.Sequential`` is. It holds the parts, not
    copies; the root (``root``, kept outside the chain's submodules) keeps them until the stage is
    installed (:func:`lightning_gpipe.partition.plan.install`).

    Args:
        root: the module whose forward is the chain (the LightningModule or one of its submodules).
        root_name: its attribute path in the LightningModule (``""``: the LightningModule itself).
        steps: ``(part, inputs, outputs)`` per part in call order; ``inputs``/``outputs`` are ``None``
            for a list plan (each layer takes the previous one's output), else the names of a dict plan
            (the transformers ``{name: (inputs, outputs)}`` format).

    Attributes:
        calls: for a dict plan, each layer's :class:`PartCall` (empty for a list plan).
        entry: for a dict plan, the forward's arguments the chain takes, by name; ``None`` for a list plan.
        result: for a dict plan, the names the chain returns; ``None`` for a list plan.
        original: the root's submodules before the stage replaced its parts (while installed).
    """

    root: nn.Module

    def __init__(self, root: nn.Module, root_name: str, steps: Sequence[Step]) -> None:
        super().__init__()
        object.__setattr__(self, "root", root)  # not a submodule: the chain's keys are the root's
        self.root_name, self.steps = root_name, list(steps)
        self.parts = [part for part, _, _ in steps]
        self.original: dict[str, Any] | None = None
        layers: list[tuple[str, nn.Module, Step]] = []
        for step in steps:
            module = children(root)[step[0]]
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                layers += [(f"{step[0]}.{k}", item, step) for k, item in children(module).items()]
            else:
                layers.append((step[0], module, step))
        children(self).update((name, module) for name, module, _ in layers)
        self.layer_parts = {name: step[0] for name, _, step in layers}
        self.calls: dict[str, PartCall] = {}
        self.entry: list[str] | None = None
        self.result: list[str] | None = None
        if steps and steps[0][1] is not None:
            self._dict_plan(layers)

    def _dict_plan(self, layers: list[tuple[str, nn.Module, Step]]) -> None:
        made: set[str] = set()
        entry: list[str] = []
        for _, _, (_, inputs, outputs) in layers:
            entry += [n for n in inputs or () if n not in made and n not in entry]
            made.update(outputs or ())
        self.entry, self.result = entry, list(layers[-1][2][2] or ())
        for k, (name, _, (_, inputs, outputs)) in enumerate(layers):
            later = {n for _, _, step in layers[k + 1 :] for n in step[1] or ()} | set(self.result)
            self.calls[name] = PartCall(name, inputs or (), outputs or (), sorted(later))

    @property
    def described(self) -> str:
        """The chain as the plan names it: ``embed → blocks[0..5] → norm → head``."""
        shown = []
        for part in self.parts:
            items = [n for n, p in self.layer_parts.items() if p == part and n != part]
            shown.append(f"{part}[{items[0].split('.')[-1]}..{items[-1].split('.')[-1]}]" if items else part)
        return " → ".join(shown)
