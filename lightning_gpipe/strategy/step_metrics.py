"""torchmetrics metrics updated by a step's micro-batch calls: their step value is the whole batch's.

A ``Metric`` logged with ``on_step=True`` (``self.acc(logits, y); self.log("acc", self.acc)``)
reports its ``forward``'s value, computed on the last ``forward``'s inputs. When ``training_step``
runs once per micro-batch (:mod:`lightning_gpipe.strategy.microstep`) that is the last
micro-batch's. So around the calls each metric of the module (outside the pipelined Sequential)
keeps the step's updates apart (:func:`isolate`): its accumulated state is set aside and it starts
the step from its defaults; after the calls (:func:`rejoin`) the metric's value over the step's
updates, the whole batch's, becomes its step value (``_forward_cache``, what Lightning logs), computed
as ``forward`` computes its batch value, and the state set aside is merged back with the step's as
``forward`` merges a batch's (``Metric._reduce_states``), the step counting as one update. The epoch
value (``compute()``) then sees every update, as on one device.

A metric whose state cannot be merged that way (a tensor state with ``dist_reduce_fx=None``) is
left alone: its step value stays the last micro-batch's, with a warning once.

A value a metric's ``forward`` returned and the step logs (``self.log("acc", self.acc(logits, y))``,
``self.log_dict(self.metrics(logits, y))`` with a ``MetricCollection``) is logged as that metric's
batch value too (:class:`lightning_gpipe.strategy.microstep.MicroSteps` recognises it), not as a
combination of the micro-batches' values (exact for a micro-averaged accuracy, not for an F1 score).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torchmetrics import Metric

__all__ = ["Isolated", "isolate", "rejoin"]

_WARNED: set[str] = set()


@dataclass
class Isolated:
    """A metric whose accumulated ``state`` (and ``count`` of updates) is set aside for a step."""

    metric: Metric
    state: dict[str, Any]
    count: int
    cache: Any  # its step value before the step (kept where the step does not update it)


def _mergeable(metric: Metric) -> bool:
    return all(
        not (isinstance(default, Tensor) and metric._reductions[name] is None)
        for name, default in metric._defaults.items()
    )


def isolate(module: nn.Module, pipelined: nn.Module | None) -> list[Isolated]:
    """Set aside the accumulated state of each of ``module``'s metrics outside ``pipelined`` (the
    stage: its layers' metrics update in the forwards), each starting afresh from its defaults."""
    inside = {id(m) for m in pipelined.modules()} if pipelined is not None else set()
    held = []
    for m in module.modules():
        if not isinstance(m, Metric) or id(m) in inside:
            continue
        if not _mergeable(m):
            name = type(m).__name__
            if name not in _WARNED:
                _WARNED.add(name)
                warnings.warn(
                    f"{name} has a tensor state with dist_reduce_fx=None: logged on_step while "
                    "training_step runs once per micro-batch, its step value is the last micro-batch's "
                    "(its epoch value is the whole epoch's); give the state a reduction or use "
                    "schedule='gpipe'",
                    stacklevel=2,
                )
            continue
        state = {}
        for name, default in m._defaults.items():
            current = getattr(m, name)
            state[name] = current
            fresh: Tensor | list[Any] = (
                default.detach().clone().to(current.device) if isinstance(default, Tensor) else []
            )
            setattr(m, name, fresh)
        held.append(Isolated(m, state, m._update_count, m._forward_cache))
        m._update_count, m._forward_cache, m._computed = 0, None, None
    return held


def rejoin(held: list[Isolated]) -> None:
    """After the step's calls: each metric ``forward`` updated gets the batch's value as its step value;
    every metric gets its state set aside back, merged with the step's."""
    for h in held:  # every metric holds the step's state only, so a composition computes the batch's too
        updated = h.metric._forward_cache is not None
        h.metric._forward_cache = _batch_value(h.metric) if updated else h.cache
    for h in held:
        m = h.metric
        if m._update_count == 0:  # not updated in the step: its state as it was
            for name, value in h.state.items():
                setattr(m, name, value)
            m._update_count = h.count
        elif h.count > 0:  # merged as forward merges a batch's state, the step counting as one update
            m._update_count = h.count + 1
            m._reduce_states(h.state)
            if m.compute_on_cpu:
                m._move_list_states_to_cpu()
        else:
            m._update_count = 1
        m._computed = None


def _batch_value(metric: Metric) -> Any:
    """``metric.compute()`` over its current state with the settings ``forward`` computes a batch's value
    with (synced only with ``dist_sync_on_step``, no cache kept)."""
    on_cpu = metric.compute_on_cpu
    metric._to_sync, metric._should_unsync, metric.compute_on_cpu = metric.dist_sync_on_step, False, False
    metric._computed = None
    try:
        return metric.compute()
    finally:
        metric._is_synced, metric._should_unsync = False, True
        metric._to_sync, metric._computed, metric.compute_on_cpu = metric.sync_on_compute, None, on_cpu
