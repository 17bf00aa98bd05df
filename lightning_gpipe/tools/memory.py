"""Activation memory of a pipeline schedule: each stage's peak bytes held for backward.

:func:`peak_activation_memory` plays each stage's column of a schedule (the same data the stages
execute): what a stage holds for backward grows with every forward and shrinks with every
backward, so fill-drain's peak grows with M while 1F1B's is bounded by the micro-batches in
flight (``K-j`` on stage ``j``). :mod:`lightning_gpipe.tools.simulate` adds time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_gpipe import schedule as schedule_module
from lightning_gpipe.engine.recompute import recomputed
from lightning_gpipe.errors import check_count
from lightning_gpipe.schedule import SCHEDULES, Action, Grid, Schedule
from lightning_gpipe.schedule import sizes as microbatch_sizes

__all__ = ["check_value", "grid_of", "peak_activation_memory", "per_part", "per_stage", "split_backwards"]


def peak_activation_memory(
    stages: int,
    chunks: int,
    batch_size: int,
    activation_bytes: float | Sequence[float],
    input_bytes: float | Sequence[float] = 0.0,
    checkpoint: str = "except_last",
    *,
    schedule: str | Schedule = "gpipe",
    virtual_stages: int = 1,
    workspace_bytes: float | Sequence[float] = 0.0,
    output_bytes: float = 0.0,
) -> list[float]:
    """Peak bytes of activations each stage holds for backward during one step.

    A part holds, per sample, ``activation_bytes`` (``a``) for a micro-batch whose activations
    are kept, or only its boundary input ``input_bytes`` (``b``) for a re-materialized one, which
    then needs its ``a`` again while its backward runs. The holdings are played through the
    schedule's column of each stage (every forward adds, every backward frees its micro-batch
    on its part) and each stage's maximum over all its parts together is returned. Under
    fill-drain, with ``M`` equal micro-batches of ``N/M`` on stage ``k``:

    - ``"never"``: ``N·a_k`` — all activations of the mini-batch;
    - ``"always"``: ``N·b_k + (N/M)·a_k`` — the boundary inputs of all micro-batches plus
      one micro-batch's activations, GPipe's ``O(N + (L/K)·(N/M))``;
    - ``"except_last"``: ``(N - N/M)·b_k + (N/M)·a_k``.

    Under 1F1B stage ``k`` holds at most ``K-k`` micro-batches, whatever M: ``"never"`` gives
    ``min(K-k, M)·(N/M)·a_k``.

    ``a`` is treated as the part's inner activations; if it also counts the boundary input
    (and output), as the benchmark's profile does, the estimate with re-materialization is high
    by one micro-batch's ``b`` while the recompute's backward runs.

    Two terms count what a backward needs beyond what was kept, so that the estimate is the peak
    a memory meter sees during the step (both 0 by default: the kept bytes alone):

    - ``workspace_bytes`` (``w``, bytes): one micro-batch's backward peak on a part above what
      its forward kept, added while each backward runs: the gradient arriving from the next
      part, the activation gradients passed between layers, and each weight's gradient before
      it is added into ``.grad`` (a Linear(1024, 1024)'s is 4 MiB, whatever the micro-batch).
      Measured on a micro-batch of the run's size (it depends on it);
    - ``output_bytes`` (``o``, bytes per sample): the last part's output, which the loss receives;
      while the last part's backwards run, the loss's side is alive, ``2·o`` per sample (the
      output's gradient and a loss buffer as large as the output, e.g. ``F.mse_loss``'s element-wise
      one; the output itself is the part's, in ``a``): one micro-batch's (``2·o·N/M``) under
      schedules that run the loss per micro-batch, the whole mini-batch's (``2·o·N``) under
      ``"gpipe"``, whose ``training_step`` sees the joined output of all micro-batches.

    So 1F1B's ``"never"`` peak on the last stage is ``(N/M)·a + w + 2·o·N/M``, and GPipe's
    ``N·a + w + 2·o·N``. Under the schedules that run the loss per micro-batch, the last call's
    loss side stays alive (Lightning holds the loss, whose graph holds the output's gradient)
    until the next call: a backward of another part of the last stage (interleaved) counts it.

    Args:
        stages (int): number of stages ``K``.
        chunks (int): number of micro-batches ``M`` (fewer if ``N < M``).
        batch_size (int): mini-batch size ``N``.
        activation_bytes: ``a``, bytes per sample that a stage keeps for backward without
            re-materialization; a scalar or ``K`` values (each of a stage's ``v`` parts keeps
            ``1/v`` of it), or ``K·v`` values, one per part.
        input_bytes: ``b``, bytes per sample of a part's input; a scalar, ``K`` values (every
            part of a stage) or ``K·v`` values (default: 0).
        checkpoint (str): ``"always"``, ``"except_last"`` or ``"never"`` (default:
            ``"except_last"``).
        schedule: a name in :data:`~lightning_gpipe.schedule.SCHEDULES` or a schedule
            function (default: ``"gpipe"``, fill-drain).
        virtual_stages (int): virtual stages per stage ``v`` (default: 1).
        workspace_bytes: ``w``, bytes one micro-batch's backward needs on a part beyond what
            its forward kept; a scalar, ``K`` values (every part of a stage) or ``K·v`` values
            (default: 0).
        output_bytes (float): ``o``, bytes per sample of the last part's output, the loss's
            input (default: 0).

    Returns:
        list[float]: peak bytes per stage, shape ``(K,)``.

    Raises:
        TypeError: a count is not an ``int``.
        ValueError: a count below 1, a negative or non-finite size, a list of the wrong
            length, an unknown ``checkpoint`` or ``schedule``, a ``virtual_stages`` the
            schedule cannot run.
    """
    check_count("stages", stages)
    check_count("virtual_stages", virtual_stages)
    sizes = microbatch_sizes(batch_size, chunks)
    v = virtual_stages
    a = per_part("activation_bytes", activation_bytes, stages, v, split=True)
    b = per_part("input_bytes", input_bytes, stages, v, split=False)
    w = per_part("workspace_bytes", workspace_bytes, stages, v, split=False)
    check_value("output_bytes", output_bytes)
    recompute = recomputed(checkpoint, len(sizes))
    grid = grid_of(schedule, stages, len(sizes), v)
    whole_batch = schedule in ("gpipe", schedule_module.fill_drain)  # one training_step per mini-batch
    last = stages * v - 1
    peaks = []
    for k in range(stages):
        column = schedule_module.stage_actions(grid, k)
        held = peak = loss_alive = 0.0
        split = split_backwards(column, k, stages, recompute)
        for action in column:
            c, i = schedule_module.part(k, action.virtual_stage, stages), action.i
            kept = (b[c] if recompute[i] else a[c]) * sizes[i]
            if action.kind == "W":
                held -= kept if (i, c) in split else 0.0  # a split backward's graph lives until its W
            elif action.kind == "F":
                held += kept
                if c == last and not whole_batch:
                    loss_alive = 0.0  # a new call: the last one's loss is let go
            else:
                loss_side = 2 * output_bytes * (sum(sizes) if whole_batch else sizes[i]) if c == last else 0.0
                rematerialized = a[c] * sizes[i] if recompute[i] else 0.0
                others = loss_side if c == last else loss_alive
                peak = max(peak, held + rematerialized + w[c] + others)
                held -= 0.0 if (i, c) in split else kept
                loss_alive = loss_side if c == last else loss_alive
            peak = max(peak, held + loss_alive)
        peaks.append(peak)
    return peaks


def split_backwards(
    column: Sequence[Action], stage: int, stages: int, recompute: Sequence[bool]
) -> set[tuple[int, int]]:
    """``(micro-batch, part)`` of the backwards that ``column`` splits into ``B`` and ``W``: those with a
    ``W`` of their own, unless recomputed (:mod:`lightning_gpipe.engine.backward_split`). (The first stage
    runs its backwards whole, as its input needs no gradient; under ``"zb_h1"`` its ``W`` follows its
    ``B`` at once, so the times are the same.)"""
    return {
        (a.i, schedule_module.part(stage, a.virtual_stage, stages))
        for a in column
        if a.kind == "W" and not recompute[a.i]
    }


def grid_of(schedule: str | Schedule, stages: int, chunks: int, virtual_stages: int) -> Grid:
    """The grid of ``schedule`` (a name in :data:`~lightning_gpipe.schedule.SCHEDULES` or a function)."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule (schedule: {schedule!r}); choose one of {', '.join(map(repr, SCHEDULES))}"
            )
        schedule = SCHEDULES[schedule]
    return schedule(stages, chunks, virtual_stages)


def check_value(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and non-negative (got {value})")


def per_part(
    name: str, value: float | Sequence[float], stages: int, virtual_stages: int, *, split: bool
) -> list[float]:
    """One value per part ``c`` (stage ``c mod K``'s virtual stage ``c // K``).

    A scalar or ``K`` values (one per stage) give each of a stage's parts the stage's value,
    divided by ``v`` when ``split`` (a time or a size the stage's parts share); ``K·v`` values
    are the parts' own.
    """
    parts = stages * virtual_stages
    if isinstance(value, (int, float)) or virtual_stages == 1 or len(value) != parts:
        try:
            each = per_stage(name, value, stages)
        except ValueError:
            if virtual_stages == 1:
                raise
            raise ValueError(
                f"{name} needs {stages} values (one per stage) or {parts} (one per part) (got {len(value)})"  # type: ignore[arg-type]
            ) from None
        share = virtual_stages if split else 1
        return [each[c % stages] / share for c in range(parts)]
    return per_stage(name, value, parts)


def per_stage(name: str, value: float | Sequence[float], length: int) -> list[float]:
    """A scalar broadcast to ``length`` values, or a sequence checked to be ``length`` long."""
    if isinstance(value, (int, float)):
        values = [float(value)] * length
    else:
        values = [float(v) for v in value]
        if len(values) != length:
            raise ValueError(f"{name} needs {length} values, one per stage or boundary (got {len(values)})")
    for v in values:
        check_value(name, v)
    return values
