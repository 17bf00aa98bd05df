"""Choosing a balance: how many consecutive layers of an ``nn.Sequential`` each stage gets.

A balance is a list ``[n0, n1, ..., n_{K-1}]`` of layers per stage (each ``>= 1``, summing
to the number of layers). A pipeline runs at the pace of its slowest stage and must fit in
its fullest device, so a good balance minimises the largest stage cost. The functions here
measure or count a cost per layer and choose the contiguous partition whose largest stage
cost is minimal (exactly; see ``blockpartition.solve``).

The approach follows torchgpipe's ``balance_by_time`` and ``balance_by_size``
(kakaobrain/torchgpipe, ``torchgpipe/balance/``) and the partitioning step of GPipe
(Huang et al., 2019, arXiv 1811.06965, section 2.2: "partition ... to minimise the variance
in the estimated costs of all cells").

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    >>> balance_by_parameters(model, 2)
    [2, 3]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_gpipe.balance import blockpartition
from lightning_gpipe.balance.profile import (
    LayerProfile,
    LayerProfilingError,
    Sample,
    layer_parameters,
    profile_layers,
    profile_sizes,
    profile_times,
)
from lightning_gpipe.errors import check_count
from lightning_gpipe.schedule import sizes

__all__ = [
    "LayerProfile",
    "LayerProfilingError",
    "balance_by_memory",
    "balance_by_parameters",
    "balance_by_size",
    "balance_by_time",
    "balance_cost",
    "profile_layers",
    "profile_sizes",
    "profile_times",
    "uniform_balance",
]


def _check_layers(module: nn.Module, stages: int) -> None:
    """Raises before any profiling if ``module`` or ``stages`` cannot work."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential (got {type(module).__name__})")
    blockpartition.validate_costs([0.0] * len(module), stages)


def balance_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Balance minimising the largest stage cost for given per-layer costs.

    Args:
        costs (Sequence[float]): non-negative cost of each layer in model order, shape
            ``(L,)``, in any additive unit (seconds, bytes, parameter counts).
        stages (int): number of stages ``K``, ``1 <= K <= L``.

    Returns:
        list[int]: layers per stage, ``K`` entries, each ``>= 1``, summing to ``L``. Ties
        are broken as documented in ``blockpartition``.

    Raises:
        TypeError: ``stages`` is not an ``int``.
        ValueError: ``stages < 1``, more stages than layers, or a negative, NaN or
            infinite cost.
    """
    return blockpartition.solve(costs, stages)


def uniform_balance(num_layers: int, stages: int) -> list[int]:
    """Balance that is as even as possible by layer count, ignoring costs.

    Stages differ by at most one layer; the larger stages come **first**
    (``uniform_balance(10, 4) == [3, 3, 2, 2]``), so the last stage, which also computes
    the loss, gets the lighter share.

    Args:
        num_layers (int): number of layers ``L``.
        stages (int): number of stages ``K``, ``1 <= K <= L``.

    Returns:
        list[int]: layers per stage.

    Raises:
        TypeError: ``num_layers`` or ``stages`` is not an ``int``.
        ValueError: ``stages < 1`` or more stages than layers.
    """
    check_count("num_layers", num_layers)
    blockpartition.validate_costs([0.0] * max(num_layers, 0), stages)
    return sizes(num_layers, stages)  # the near-equal split, larger first (stages <= num_layers here)


def balance_by_parameters(module: nn.Sequential, stages: int) -> list[int]:
    """Balance minimising the largest number of parameter elements per stage.

    No data needed; a good proxy for memory when parameters and optimizer state dominate.
    Layers without parameters cost 0 and are spread to keep layer counts even.

    Args:
        module (nn.Sequential): the model, ``L`` layers.
        stages (int): number of stages ``K``, ``1 <= K <= L``.

    Returns:
        list[int]: layers per stage.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or ``stages`` is not an int.
        ValueError: ``stages < 1`` or more stages than layers.
    """
    _check_layers(module, stages)
    return blockpartition.solve(layer_parameters(module), stages)


def balance_by_time(
    module: nn.Sequential,
    sample: Sample,
    stages: int,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance minimising the largest profiled forward+backward time per stage.

    Each layer is profiled on ``sample`` (see ``profile_layers``: warm-up, then repeated
    passes for ``timeout`` seconds, median per layer) and the balance minimises the largest
    sum of per-layer seconds. torchgpipe's ``balance_by_time`` is the reference.

    Args:
        module (nn.Sequential): the model, ``L`` layers; restored after profiling.
        sample: a micro-batch as a stage will see it: a tensor ``(N/M, *)`` or a tuple of
            tensors, batch along dim 0.
        stages (int): number of stages ``K``, ``1 <= K <= L``.
        timeout (float): seconds of measured passes (default: 1.0).
        device: where to profile (default: the sample's device).

    Returns:
        list[int]: layers per stage.

    Raises:
        TypeError: bad ``module``/``sample``/``stages`` types.
        ValueError: ``stages < 1``, more stages than layers, ``timeout < 0``.
        LayerProfilingError: a layer raised; the message names it, the cause is chained.
    """
    _check_layers(module, stages)
    costs = profile_times(module, sample, timeout=timeout, device=device)
    return blockpartition.solve(costs, stages)


def balance_by_memory(
    module: nn.Sequential,
    sample: Sample,
    stages: int,
    *,
    optimizer_factor: float = 3.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance minimising the largest profiled training memory per stage, in bytes.

    Per layer: bytes the layer saves for backward on ``sample`` (measured with
    ``torch.autograd.graph.saved_tensors_hooks``) plus ``parameter_bytes × (1 +
    optimizer_factor)``. torchgpipe's ``balance_by_size`` is the reference.

    Args:
        module (nn.Sequential): the model, ``L`` layers; restored after profiling.
        sample: a tensor ``(n, *)`` or tuple of tensors, batch along dim 0. Activations
            scale with ``n``: use the whole mini-batch (``N``) without re-materialization,
            about one micro-batch (``N/M``) with ``checkpoint="always"``.
        stages (int): number of stages ``K``, ``1 <= K <= L``.
        optimizer_factor (float): gradient + optimizer-state bytes per parameter byte: 1 for
            SGD, 2 for SGD with momentum, 3 for Adam/AdamW (default: 3.0).
        device: where to profile (default: the sample's device).

    Returns:
        list[int]: layers per stage.

    Raises:
        TypeError: bad ``module``/``sample``/``stages`` types.
        ValueError: ``stages < 1``, more stages than layers, negative
            ``optimizer_factor``.
        LayerProfilingError: a layer raised; the message names it, the cause is chained.
    """
    _check_layers(module, stages)
    costs = profile_sizes(module, sample, optimizer_factor=optimizer_factor, device=device)
    return blockpartition.solve(costs, stages)


balance_by_size = balance_by_memory
"""Alias of ``balance_by_memory`` under torchgpipe's name."""
