"""Find the user's pipelined ``nn.Sequential``, cut it into stages, and install a stage in its place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import children, register_state_dict_hook
from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.batchnorm import defer_batch_norms, restore_batch_norms
from lightning_gpipe.engine.skip import routes
from lightning_gpipe.errors import PartitionError, listed
from lightning_gpipe.partition.compiling import Uncompiled
from lightning_gpipe.partition.tied import tied_buffers
from lightning_gpipe.transport.layout import layer_parts


def find_sequential(module: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """Find the ``nn.Sequential`` to pipeline inside ``module``.

    Args:
        module: the LightningModule (or any module).
        module_name: dotted attribute path of the Sequential (e.g. ``"model.layers"``; of a
            ``torch.compile``-d one, its wrapper's or ``"model.layers._orig_mod"``); ``None`` picks
            the only ``nn.Sequential`` that holds every parameter of ``module``.

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
        if isinstance(found, Uncompiled):  # the user's compiled Sequential: named as the model names it
            module_name, found = f"{module_name}._orig_mod", found._orig_mod
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
            f"{type(module).__name__} has no nn.Sequential holding all of its parameters (nn.Sequential "
            f"submodules: {_sequential_names(module) or 'none'}); put the layers to pipeline in one "
            "nn.Sequential and keep every parameter inside it, or pass GPipeStrategy(module_name=...)"
        )
    names = ", ".join(name for name, _ in candidates)
    raise PartitionError(
        f"several nn.Sequential submodules of {type(module).__name__} hold all parameters ({names}); "
        "pass GPipeStrategy(module_name=...) to choose the one to pipeline"
    )


def check_model(
    model: Any, module_name: str | None, balance: list[int] | str | None, stages: int, virtual_stages: int = 1
) -> tuple[str, nn.Sequential, list[int]]:
    """Find the pipelined Sequential of a LightningModule and the balance to cut it with.

    Args:
        model: the LightningModule.
        module_name: see :func:`find_sequential`.
        balance: a list of layers per part (checked), or anything else for the uniform split
            (a balancer's choice is made later, :mod:`lightning_gpipe.strategy.balance_spec`).
        stages: the number of stages K.
        virtual_stages: virtual stages per stage v; the Sequential is cut into ``K·v`` parts
            (default 1: one part per stage).

    Returns:
        ``(name, sequential, balance)``.

    Raises:
        PartitionError: no unique Sequential, parameters outside it, or a balance/stage count
            that does not fit its layers.
        ValueError: the module uses manual optimization (with more than one stage).
    """
    name, seq = find_sequential(model, module_name)
    return check_cut(model, name, seq, balance, stages, virtual_stages)


def check_cut(model: Any, name: str, seq: Any, balance: Any, stages: int, v: int) -> tuple[str, Any, Any]:
    """:func:`check_model` once the Sequential (or a plan's chain) is found."""
    if stages > 1 and not model.automatic_optimization:
        raise ValueError(
            f"{type(model).__name__} uses manual optimization (automatic_optimization = False), which the "
            "gpipe strategy does not support: on every stage but the last, training_step ends at the "
            "pipelined call, before the user's backward and optimizer step; use automatic optimization"
        )
    parts = stages * v
    if isinstance(balance, list):
        check_stages(len(seq), len(balance) if v == 1 else stages)  # v > 1: check_balance names the parts
        balance = check_balance(balance, len(seq), parts, v, getattr(seq, "described", None))
        check_tied_parameters(seq, balance, stages)
    else:
        check_stages(len(seq), stages, v)
        balance = uniform_balance(len(seq), parts)
    return name, seq, balance


def check_all_parameters_inside(module: nn.Module, name: str, sequential: nn.Sequential) -> None:
    """Raise :class:`PartitionError` naming parameters of ``module`` outside ``sequential``."""
    inside = {id(p) for p in sequential.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in inside]
    if outside:
        shown = listed(outside)
        raise PartitionError(
            f"parameters outside the pipelined nn.Sequential {name!r}: {shown}; "
            "every parameter must live inside it (move those layers into the Sequential)"
        )


def _sequential_names(module: nn.Module) -> str:
    return ", ".join(repr(n) for n, m in module.named_modules() if isinstance(m, nn.Sequential) and n)


def check_stages(num_layers: int, stages: int, virtual_stages: int = 1) -> None:
    """Raise unless ``num_layers`` layers fill ``stages × virtual_stages`` parts of one layer or more.

    Raises:
        PartitionError: more stages than layers (the fix: fewer processes), or, with virtual stages,
            more parts than layers (the fix: the virtual stages that fit, or one part per stage).
    """
    if stages < 1:
        raise PartitionError(f"stages must be an integer >= 1 (stages: {stages!r})")
    if stages > num_layers:
        raise PartitionError(
            f"more pipeline stages than layers (stages: {stages}, layers: {num_layers}); "
            "use fewer processes (devices × num_nodes / data-parallel size) or a deeper nn.Sequential"
        )
    parts = stages * virtual_stages
    if parts > num_layers:
        fits = num_layers // stages
        fix = f"virtual_stages={fits}" if fits >= 2 else "schedule='1f1b' (one part per stage)"
        raise PartitionError(
            f"more parts than layers: schedule='interleaved_1f1b' cuts the nn.Sequential into stages × "
            f"virtual stages = {stages} × {virtual_stages} = {parts} parts of one layer or more, and it has "
            f"{num_layers} layers; use {fix}, or a deeper nn.Sequential"
        )


def _even(num_layers: int, parts: int) -> list[int]:
    """``num_layers`` layers over ``parts`` parts as evenly as can be, the larger parts first."""
    return [num_layers // parts + (1 if i < num_layers % parts else 0) for i in range(parts)]


def check_balance(
    balance: Sequence[int],
    num_layers: int,
    stages: int | None = None,
    virtual_stages: int = 1,
    chain: str | None = None,
) -> list[int]:
    """Validate a balance list (layers per stage; with virtual stages, per part).

    Args:
        stages: the number of entries the balance must have (stages × virtual stages).
        virtual_stages: virtual stages per stage v, for the message.
        chain: a plan's chain as it names it (``embed → blocks[0..3] → norm → head``), for the message;
            ``None`` for an ``nn.Sequential``.

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
        parts = stages or len(balance)
        hint = f", e.g. balance={_even(num_layers, parts)}" if parts <= num_layers else ""
        holder = (
            f"the plan's chain {chain} (a ModuleList's items one layer each)"
            if chain
            else "the nn.Sequential"
        )
        raise PartitionError(
            f"balance={balance} places {sum(balance)} layers but {holder} has {num_layers}: give "
            f'layers per stage that add up to {num_layers}{hint}, or a balancer (balance="uniform", '
            '"parameters", "time", "memory")'
        )
    if stages is not None and len(balance) != stages and virtual_stages > 1:
        raise PartitionError(
            f"balance has {len(balance)} entries but the pipeline has {stages} parts "
            f"({stages // virtual_stages} stages × {virtual_stages} virtual stages; balance: {balance}); "
            "give one entry per part, in model order"
        )
    if stages is not None and len(balance) != stages:
        raise PartitionError(
            f"balance has {len(balance)} stages but the pipeline has {stages} (balance: {balance}); "
            "give one entry per pipeline stage"
        )
    return balance


def check_skips_within_parts(sequential: nn.Sequential, balance: Sequence[int]) -> None:
    """Raise :class:`PartitionError` for a skip connection between different parts (virtual stages).

    Raises:
        PartitionError: a :class:`~lightning_gpipe.engine.skip.Stash` and its
            :class:`~lightning_gpipe.engine.skip.Pop` fall in different parts of ``balance``.
    """
    crossing = [r for r in routes(sequential, layer_parts(balance)) if r.source != r.target]
    if crossing:
        names = ", ".join(f"{r.name!r} (parts {r.source} -> {r.target})" for r in crossing)
        raise PartitionError(
            f"skip connections across parts are not supported with virtual stages ({names}; balance: "
            f"{list(balance)}); choose a balance that keeps each Stash with its Pop, or virtual_stages=1"
        )


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` layer indices of every entry of ``balance`` (a stage; with virtual stages,
    a part)."""
    bounds, start = [], 0
    for n in balance:
        bounds.append((start, start + n))
        start += n
    return bounds


def cut(
    sequential: nn.Sequential, balance: Sequence[int], stage: int, stages: int | None = None
) -> list[tuple[str, nn.Module]]:
    """The ``(name, layer)`` pairs of stage ``stage``, names as in ``sequential``, in model order.

    With ``stages`` K below ``len(balance)`` (virtual stages: ``balance`` has one entry per part),
    stage ``j`` holds parts ``j, j+K, j+2K, …`` (:func:`lightning_gpipe.schedule.part`).
    """
    return [pair for layers in virtual_cut(sequential, balance, stage, stages) for pair in layers]


def virtual_cut(
    sequential: nn.Sequential, balance: Sequence[int], stage: int, stages: int | None = None
) -> list[list[tuple[str, nn.Module]]]:
    """Stage ``stage``'s layers per virtual stage: part ``stage + u·K`` for ``u = 0 … v-1``.

    Args:
        balance: layers per part, ``K·v`` entries.
        stages: the number of stages K (default: ``len(balance)``, one part per stage).

    Raises:
        PartitionError: ``len(balance)`` is not a multiple of ``stages``.
    """
    k = len(balance) if stages is None else stages
    if k < 1 or len(balance) % k:
        raise PartitionError(
            f"a balance of {len(balance)} parts cannot be dealt to {k} stages (balance: {list(balance)}); "
            "give stages × virtual_stages entries"
        )
    named = list(children(sequential).items())  # named_children() would drop a repeated module
    bounds = stage_bounds(balance)
    return [named[slice(*bounds[c])] for c in range(stage, len(balance), k)]


def check_tied_parameters(
    sequential: nn.Sequential, balance: Sequence[int], stages: int | None = None
) -> None:
    """Raise :class:`PartitionError` for what tying across stages cannot make exact: a shared buffer.

    Parameters shared by layers on different stages are kept in step by
    :mod:`lightning_gpipe.partition.tied`; buffers are refused
    (:func:`lightning_gpipe.partition.tied.tied_buffers`).
    """
    for tied in tied_buffers(sequential, balance, stages):
        raise PartitionError(
            f"the buffer {tied.names[0]!r} is shared by layers on stages {list(tied.stages)} (names: "
            f"{', '.join(tied.names)}, balance: {list(balance)}); a buffer updated in place by one stage's "
            "forward (e.g. BatchNorm running statistics) cannot stay equal on the others, so keep the layers "
            "sharing it on one stage (choose a balance that does) or give each its own buffer"
        )


def placement(sequential: nn.Sequential, balance: Sequence[int], ranks: Sequence[int]) -> str:
    """Where the layers went, one line per stage: ``stage j (rank r): layers a..b, n parameters``.

    With virtual stages (``len(ranks)`` stages K, ``balance`` of ``K·v`` parts) a stage's line
    names each of its parts' layer ranges (``layers 0..1 + 4..5``).

    Args:
        sequential: the whole pipelined Sequential.
        balance: layers per stage (per part with virtual stages).
        ranks: the global rank of each stage (of the first pipeline).
    """
    names = list(sequential._modules)
    layers = list(sequential._modules.values())
    total = sum(p.numel() for p in sequential.parameters())
    k = len(ranks)
    v = len(balance) // k
    head = f"gpipe: {k} stages" + (f" × {v} virtual stages" if v > 1 else "")
    lines = [f"{head} over {len(names)} layers, {total:,} parameters in all"]
    bounds = stage_bounds(balance)
    for j in range(k):
        seen: set[int] = set()
        count = 0
        ranges = []
        for start, stop in bounds[j::k]:
            ranges.append(f"{names[start]}..{names[stop - 1]}")
            for layer in layers[start:stop]:
                for p in layer.parameters() if layer is not None else ():
                    if id(p) not in seen:
                        seen.add(id(p))
                        count += p.numel()
        lines.append(f"  stage {j} (rank {ranks[j]}): layers {' + '.join(ranges)}, {count:,} parameters")
    return "\n".join(lines)


@dataclass
class Installed:
    """Where a stage replaced the user's Sequential: ``parent.<attr>`` (``name`` in the model) was
    ``sequential``."""

    name: str
    parent: nn.Module
    attr: str
    sequential: nn.Sequential
    batch_norms: list[tuple[nn.Module, str, nn.Module]]  # originals of deferred BatchNorms


def install(model: nn.Module, name: str, stage: nn.Module, deferred_batch_norm: bool = False) -> Installed:
    """Put ``stage`` where the Sequential ``name`` (a dotted path in ``model``) was; undo with
    :func:`uninstall`.

    With ``deferred_batch_norm``, the stage's BatchNorms become
    :class:`~lightning_gpipe.engine.batchnorm.DeferredBatchNorm` (sharing parameters and buffers).
    """
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    batch_norms = defer_batch_norms(stage) if deferred_batch_norm else []
    installed = Installed(name, parent, attr, getattr(parent, attr), batch_norms)
    setattr(parent, attr, stage)
    return installed


def uninstall(installed: Installed, state: dict[str, Any] | None = None) -> nn.Sequential:
    """Put the user's Sequential back (its BatchNorms as they were), loaded with ``state`` if given;
    return it."""
    restore_batch_norms(installed.batch_norms)
    if state is not None:
        installed.sequential.load_state_dict(state)
    setattr(installed.parent, installed.attr, installed.sequential)
    return installed.sequential


@contextlib.contextmanager
def whole_sequential(installed: Installed | None, stage: nn.Module | None) -> Iterator[None]:
    """The model holds the user's whole Sequential in place of ``stage`` inside this context, the
    stage after it."""
    if installed is None or stage is None:
        yield
        return
    setattr(installed.parent, installed.attr, installed.sequential)
    try:
        yield
    finally:
        setattr(installed.parent, installed.attr, stage)


def key_prefix(name: str) -> str:
    """What the model's keys of the pipelined part start with: ``"layers."`` (``""``: a plan's root)."""
    return name + "." if name else ""


def plain_parameter_names(name: str, seq: nn.Module) -> list[str]:
    """The parameter names of the pipelined Sequential ``seq`` (at ``name``) as the model names them, in
    model order, a parameter shared by several layers once, under its first name (as a one-device
    optimizer holds it). Taken before a stage is materialized: that ends a tie's sharing with the other
    stages' layers, which stay on the meta device."""
    return [key_prefix(name) + n for n, _ in seq.named_parameters()]


PLACEHOLDER = "_gpipe_placeholder"


def add_placeholder_parameter(stage: nn.Module, device: torch.device) -> None:
    """A stage without trainable parameters (only ReLU, or all frozen) gets an empty one, so that
    ``configure_optimizers`` as written (even ``filter(lambda p: p.requires_grad, ...)``) builds.

    It never reaches a ``state_dict``, a checkpoint or a merged optimizer state, and loads never
    need it. A stage with a trainable parameter is left as it is.
    """
    if any(p.requires_grad for p in stage.parameters()):
        return
    stage.register_parameter(PLACEHOLDER, nn.Parameter(torch.zeros(0, device=device)))

    def drop(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state.pop(prefix + PLACEHOLDER, None)

    register_state_dict_hook(stage, drop)

    def fill(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        state.setdefault(prefix + PLACEHOLDER, getattr(module, PLACEHOLDER))

    stage.register_load_state_dict_pre_hook(fill)
