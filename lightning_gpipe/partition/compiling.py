"""How each stage is compiled: ``GPipeStrategy(compile=...)`` or the user's own ``torch.compile``.

A ``torch.compile``-d ``nn.Sequential`` is an ``OptimizedModule`` whose ``_orig_mod`` child is the
Sequential, so the model names its parameters ``layers._orig_mod.0.weight``. During ``fit`` an
:class:`Uncompiled` stands in for the wrapper: the Sequential (then the stage in its place) stays its
``_orig_mod`` child, so every name the strategy writes or reads (checkpoints, optimizer states, the
whole model's parameters) is the one the model has on one device, with no translation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import OptimizedModule, children, compile_like, compiled_module


def check_compile(compile: Any) -> bool | dict[str, Any]:
    """Validate ``GPipeStrategy(compile=...)``: a bool or a dict of ``torch.compile`` arguments.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(compile, (bool, dict)):
        raise ValueError(
            f"compile must be a bool or a dict of torch.compile arguments (compile: {compile!r}); "
            'e.g. compile={"backend": "inductor", "mode": "max-autotune"}'
        )
    return compile


def stage_compiler(
    compile: bool | dict[str, Any], user_compile: Callable[[nn.Module], nn.Module] | None
) -> Callable[[nn.Module], nn.Module] | None:
    """How each stage's layers are compiled: ``compile=`` (``torch.compile`` with those arguments), else
    like the user's compiled Sequential (:func:`uncompile`), else ``None`` (not compiled)."""
    if compile:
        kwargs = compile if isinstance(compile, dict) else {}
        return lambda module: torch.compile(module, **kwargs)  # type: ignore[return-value]
    return user_compile


def compiled_sequentials(module: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """Every ``torch.compile``-d ``nn.Sequential`` inside ``module``: ``(parent, attribute, compiled)``.

    ``model.net = torch.compile(model.net)`` puts an ``OptimizedModule`` in the model whose
    ``forward`` runs the original Sequential's code: the pipeline must cut and replace that
    Sequential (see :func:`uncompile`) and compile each stage instead.
    """
    found: list[tuple[nn.Module, str, Any]] = []
    for parent in module.modules():
        for attr, child in children(parent).items():
            if isinstance(child, OptimizedModule) and isinstance(compiled_module(child), nn.Sequential):
                found.append((parent, attr, child))
    return found


class Uncompiled(nn.Module):
    """The user's ``torch.compile`` wrapper of a module, during ``fit``, without the compiling: its
    ``_orig_mod`` child is the module (or the stage in its place), called as it is.

    Like ``OptimizedModule`` it passes ``len()`` and the attributes it lacks on to ``_orig_mod``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._orig_mod)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("_orig_mod")  # absent while a copy is built
            if inner is None:
                raise
            return getattr(inner, name)


def uncompile(
    module: nn.Module,
) -> tuple[list[tuple[nn.Module, str, Any]], Callable[[nn.Module], nn.Module] | None]:
    """Put an :class:`Uncompiled` holding each compiled ``nn.Sequential`` of ``module`` in place of its
    ``OptimizedModule`` (the Sequential is then at ``<name>._orig_mod``, as the model names it).

    Returns:
        ``(undone, compile)``: what was replaced, to put back with :func:`recompile`, and a
        function that compiles a module with the same ``torch.compile`` settings (backend, mode,
        dynamic, fullgraph, options: the user's own compile context), or ``None`` when nothing was
        compiled.
    """
    undone = compiled_sequentials(module)
    for parent, attr, compiled in undone:
        children(parent)[attr] = Uncompiled(compiled_module(compiled))
    if not undone:
        return [], None
    first = undone[0][2]
    return undone, lambda m: compile_like(first, m)


def recompile(undone: list[tuple[nn.Module, str, Any]]) -> None:
    """Undo :func:`uncompile`: the user's ``OptimizedModule`` wrappers back in place (after fit)."""
    for parent, attr, compiled in undone:
        children(parent)[attr] = compiled
