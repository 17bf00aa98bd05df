"""Find the user's pipelined ``nn.Sequential`` and cut it into stages from a balance list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn


class PartitionError(ValueError):
    """The module cannot be cut into the requested stages."""


def find_sequential(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """Find the ``nn.Sequential`` to pipeline inside ``module``.

    Args:
        module: the LightningModule (or any module).
        module_name: dotted attribute path of the Sequential (e.g. ``"model.layers"``); ``None``
            picks the only ``nn.Sequential`` that holds every parameter of ``module``.

    Returns:
        ``(name, sequential)``.

    Raises:
        PartitionError: the name does not lead to an ``nn.Sequential``; no or several candidates
            (the message lists them and says to pass ``module_name``); parameters live outside it.
    """
    if module_name is not None:
        try:
            found = module.get_submodule(module_name)
        except AttributeError as err:
            raise PartitionError(
                f"module_name={module_name!r} does not name a submodule of {type(module).__name__}; "
                f"its nn.Sequential submodules are: {_sequential_names(module) or 'none'}"
            ) from err
        if not isinstance(found, nn.Sequential):
            raise PartitionError(
                f"module_name={module_name!r} names a {type(found).__name__}, not an nn.Sequential; "
                "the pipeline cuts an nn.Sequential into stages"
            )
        check_all_parameters_inside(module, module_name, found)
        return module_name, found

    everything = {id(p) for p in module.parameters()}
    candidates = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.Sequential) and name and {id(p) for p in m.parameters()} == everything
    ]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise PartitionError(
            f"{type(module).__name__} has no nn.Sequential holding all of its parameters "
            f"(nn.Sequential submodules: {_sequential_names(module) or 'none'}); put the layers to pipeline in one "
            "nn.Sequential and keep every parameter inside it, or pass GPipeStrategy(module_name=...)"
        )
    names = ", ".join(name for name, _ in candidates)
    raise PartitionError(
        f"several nn.Sequential submodules of {type(module).__name__} hold all parameters ({names}); "
        "pass GPipeStrategy(module_name=...) to choose the one to pipeline"
    )


def check_all_parameters_inside(module: nn.Module, name: str, sequential: nn.Sequential) -> None:
    """Raise :class:`PartitionError` naming parameters of ``module`` outside ``sequential``."""
    inside = {id(p) for p in sequential.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:5]) + (", ..." if len(outside) > 5 else "")
        raise PartitionError(
            f"parameters outside the pipelined nn.Sequential {name!r}: {shown}; "
            "every parameter must live inside it (move those layers into the Sequential)"
        )


def _sequential_names(module: nn.Module) -> str:
    return ", ".join(repr(n) for n, m in module.named_modules() if isinstance(m, nn.Sequential) and n)


def uniform_balance(num_layers: int, stages: int) -> list[int]:
    """Split ``num_layers`` into ``stages`` counts as even as possible, larger stages first.

    Raises:
        PartitionError: ``stages`` is below 1 or above ``num_layers``.
    """
    check_stages(num_layers, stages)
    from lightning_gpipe.balance import uniform_balance as even_split  # one implementation of the split

    return even_split(num_layers, stages)


def check_stages(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"the number of stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise PartitionError(
            f"more pipeline stages than layers (stages: {stages}, layers: {num_layers}); "
            "use fewer processes (devices × num_nodes / data-parallel size) or a deeper nn.Sequential"
        )


def check_balance(balance: Sequence[int], num_layers: int, stages: int | None = None) -> list[int]:
    """Validate a balance list (layers per stage).

    Raises:
        PartitionError: an entry is not a positive integer, the sum differs from ``num_layers``,
            or the length differs from ``stages``.
    """
    balance = list(balance)
    bad = [b for b in balance if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise PartitionError(
            f"balance entries must be positive integers (balance: {balance}); every stage needs a layer"
        )
    if sum(balance) != num_layers:
        raise PartitionError(
            f"module and sum of balance have different length (module: {num_layers}, sum of balance: {sum(balance)})"
        )
    if stages is not None and len(balance) != stages:
        raise PartitionError(
            f"balance has {len(balance)} stages but the pipeline has {stages} (balance: {balance}); "
            "give one entry per pipeline stage"
        )
    return balance


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` layer indices of every stage."""
    bounds, start = [], 0
    for n in balance:
        bounds.append((start, start + n))
        start += n
    return bounds


def cut(sequential: nn.Sequential, balance: Sequence[int], stage: int) -> list[tuple[str, nn.Module]]:
    """The ``(name, layer)`` pairs of stage ``stage``, names as in ``sequential``."""
    start, stop = stage_bounds(balance)[stage]
    return list(sequential._modules.items())[start:stop]  # named_children() would drop a repeated module


def check_tied_parameters(sequential: nn.Sequential, balance: Sequence[int]) -> None:
    """Raise :class:`PartitionError` if a parameter is shared by layers that ``balance`` puts on different stages."""
    stage_of_layer = [j for j, n in enumerate(balance) for _ in range(n)]
    owner: dict[int, int] = {}
    for k, layer in enumerate(sequential._modules.values()):
        if layer is None:
            continue
        for p in layer.parameters():
            first = owner.setdefault(id(p), k)
            if stage_of_layer[first] != stage_of_layer[k]:
                raise PartitionError(
                    f"layers {first} and {k} share a parameter (tied weights) but the balance {list(balance)} puts "
                    f"them on stages {stage_of_layer[first]} and {stage_of_layer[k]}; keep tied layers on one stage "
                    "(choose a balance that does) or untie them"
                )


def compiled_sequentials(module: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """Every ``torch.compile``-d ``nn.Sequential`` inside ``module``: ``(parent, attribute, compiled)``.

    ``model.net = torch.compile(model.net)`` puts an ``OptimizedModule`` in the model whose
    ``forward`` runs the original Sequential's code: the pipeline must cut and replace that
    Sequential (see :func:`uncompile`) and compile each stage instead.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    found: list[tuple[nn.Module, str, Any]] = []
    for parent in module.modules():
        for attr, child in parent._modules.items():
            if isinstance(child, OptimizedModule) and isinstance(child._orig_mod, nn.Sequential):
                found.append((parent, attr, child))
    return found


def uncompile(
    module: nn.Module,
) -> tuple[list[tuple[nn.Module, str, Any]], Callable[[nn.Module], nn.Module] | None]:
    """Put each compiled ``nn.Sequential`` of ``module`` back in place of its ``OptimizedModule``.

    Returns:
        ``(undone, compile)``: what was replaced, to put back with :func:`recompile`, and a
        function that compiles a module with the same ``torch.compile`` settings (backend, mode,
        dynamic, fullgraph, options: the user's own compile context), or ``None`` when nothing was
        compiled.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    undone = compiled_sequentials(module)
    for parent, attr, compiled in undone:
        parent._modules[attr] = compiled._orig_mod
    if not undone:
        return [], None
    context = undone[0][2].dynamo_ctx

    def compile_like_user(m: nn.Module) -> nn.Module:
        return OptimizedModule(m, context)

    return undone, compile_like_user


def recompile(undone: list[tuple[nn.Module, str, Any]]) -> None:
    """Undo :func:`uncompile`: the user's ``OptimizedModule`` wrappers back in place (after fit)."""
    for parent, attr, compiled in undone:
        parent._modules[attr] = compiled


def placement(sequential: nn.Sequential, balance: Sequence[int], ranks: Sequence[int]) -> str:
    """Where the layers went, one line per stage: ``stage j (rank r): layers a..b, n parameters``.

    Args:
        sequential: the whole pipelined Sequential.
        balance: layers per stage.
        ranks: the global rank of each stage (of the first pipeline).
    """
    names = list(sequential._modules)
    layers = list(sequential._modules.values())
    total = sum(p.numel() for p in sequential.parameters())
    lines = [f"gpipe: {len(balance)} stages over {len(names)} layers, {total:,} parameters in all"]
    for j, (start, stop) in enumerate(stage_bounds(balance)):
        seen: set[int] = set()
        count = 0
        for layer in layers[start:stop]:
            for p in layer.parameters() if layer is not None else ():
                if id(p) not in seen:
                    seen.add(id(p))
                    count += p.numel()
        lines.append(
            f"  stage {j} (rank {ranks[j]}): layers {names[start]}..{names[stop - 1]}, {count:,} parameters"
        )
    return "\n".join(lines)
