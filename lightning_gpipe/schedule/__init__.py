"""Pipeline schedules as data: what each stage runs, in order, and the messages each action implies.

An :class:`Action` is ``(kind, micro_batch)`` printed like ``F2`` or ``B0``. A schedule is a
*grid*: for every clock step, one cell per stage ``j`` holding that stage's action or ``None``
where it idles (a bubble). GPipe's fill-drain for K=3 stages and M=4 micro-batches (Huang et
al. 2019, figure 2c)::
    step  stage0  stage1  stage2
       0  F0      .       .
       1  F1      F0      .
       2  F2      F1      F0
       3  F3      F2      F1
       4  .       F3      F2
       5  .       .       F3
       6  .       .       B3
       7  .       B3      B2
       8  B3      B2      B1
       9  B2      B1      B0
      10  B1      B0      .
      11  B0      .       .

Forward ``i`` on stage ``j`` runs at step ``i + j``; backwards run in reverse micro-batch
order, ``B i`` on stage ``j`` at step ``(M + K - 1) + (M - 1 - i) + (K - 1 - j)``. The bubble
share is ``(K - 1) / (M + K - 1)``.

Everything that runs a schedule reads it from here: each stage's executor
(:class:`lightning_gpipe.engine.stage.PipelineStage`) consumes its own column in order
(:func:`stage_actions`), receiving and sending exactly the messages :func:`receives` and
:func:`sends` name; the cost
model (:mod:`lightning_gpipe.tools.simulate`) plays the same columns; :func:`format_grid` prints them.
A schedule is one function ``(stages, chunks, virtual_stages=1) -> Grid`` (:class:`Schedule`,
by name in :data:`SCHEDULES`); the clock only matters for printing, validation and simulation.

The package, one idea per module:

- :mod:`~lightning_gpipe.schedule.grid`: :class:`Action`, the grid, model parts on stages
  (:func:`part`, :func:`holder`), columns placed on the clock (:func:`place`), the grid's checks,
  :func:`format_grid`, the bubble (:func:`bubble_share`, :func:`ideal_bubble`);
- :mod:`~lightning_gpipe.schedule.fill_drain`: GPipe's :func:`fill_drain`;
- :mod:`~lightning_gpipe.schedule.one_f_one_b`: :func:`one_f_one_b` (PipeDream-Flush) and
  :func:`interleaved_1f1b` (virtual stages), with their grids;
- :mod:`~lightning_gpipe.schedule.zero_bubble`: :func:`zb_h1` (Zero Bubble's ZB-H1: backwards split
  into ``B``, the input gradient, and ``W``, the weight gradients);
- :mod:`~lightning_gpipe.schedule.messages`: the messages each action receives and sends
  (:func:`receives`, :func:`sends`, :func:`send_order`);
- :mod:`~lightning_gpipe.schedule.posts`: receives posted ahead as actions of a column
  (:class:`Post`, :func:`with_posts`) and :func:`validate`, which checks a grid and its columns'
  posts;
- here: :data:`SCHEDULES` by name and the checks of the strategy's ``schedule=`` and
  ``virtual_stages=`` arguments.

Where a column waits for the user's code: a forward on the first stage needs its micro-batch's
input, and a backward on the last stage needs its micro-batch's loss (:func:`needs_loss`). Under
``schedule="gpipe"`` the user's ``training_step`` runs once on the whole mini-batch, so every loss
exists only once it has returned and a stage's column runs in two phases, cut before its first
backward (:func:`split_phases`); under the other schedules it runs once per micro-batch
(:mod:`lightning_gpipe.strategy.microstep`) and the executor runs each column as far as it can between the
calls.
"""

from __future__ import annotations

from typing import Any

from lightning_gpipe.errors import check_count
from lightning_gpipe.schedule.fill_drain import fill_drain
from lightning_gpipe.schedule.grid import (
    Action,
    Grid,
    Schedule,
    bubble_share,
    format_grid,
    holder,
    ideal_bubble,
    needs_loss,
    part,
    place,
    sizes,
    split_phases,
    stage_actions,
    virtual_stages_of,
)
from lightning_gpipe.schedule.messages import (
    SkipRoute,
    Transfer,
    in_send_order,
    receives,
    send_order,
    sends,
)
from lightning_gpipe.schedule.one_f_one_b import interleaved_1f1b, one_f_one_b
from lightning_gpipe.schedule.posts import POSTED_AHEAD, Post, Step, validate, with_posts
from lightning_gpipe.schedule.zero_bubble import zb_h1

__all__ = [
    "POSTED_AHEAD",
    "SCHEDULES",
    "Action",
    "Grid",
    "Schedule",
    "SkipRoute",
    "Transfer",
    "bubble_share",
    "check_schedule",
    "check_virtual_stages",
    "fill_drain",
    "format_grid",
    "ideal_bubble",
    "in_send_order",
    "interleaved_1f1b",
    "needs_loss",
    "holder",
    "one_f_one_b",
    "part",
    "place",
    "Post",
    "receives",
    "send_order",
    "sends",
    "sizes",
    "split_phases",
    "stage_actions",
    "Step",
    "validate",
    "virtual_stages_of",
    "with_posts",
    "zb_h1",
]

SCHEDULES: dict[str, Schedule] = {
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}
"""Every schedule by the name ``GPipeStrategy(schedule=...)`` takes: a function
``(stages, chunks, virtual_stages=1) -> Grid`` (:class:`Schedule`); only ``"interleaved_1f1b"``
runs more than one virtual stage per stage.

``"gpipe"`` (:func:`fill_drain`, the default) runs the user's ``training_step`` once per mini-batch;
every other schedule runs it once per micro-batch (:mod:`lightning_gpipe.strategy.microstep`)."""


def check_virtual_stages(name: str, virtual_stages: Any, stages: int = 2) -> int:
    """Return ``virtual_stages`` if schedule ``name`` runs that many virtual stages per stage on
    ``stages`` stages.

    ``None`` picks the schedule's default: 2 for ``"interleaved_1f1b"`` (interleaving with one
    virtual stage would be plain 1F1B), 1 for the others.

    Raises:
        ValueError: not ``None`` or an integer >= 1, or the schedule cannot run it (only
            ``"interleaved_1f1b"`` runs more than one; it needs two or more stages).
    """
    if virtual_stages is None:
        virtual_stages = 2 if name == "interleaved_1f1b" else 1
    check_count("virtual_stages", virtual_stages)
    SCHEDULES[name](stages, 1, virtual_stages)  # each schedule refuses what it cannot run
    return int(virtual_stages)


def check_schedule(name: Any) -> str:
    """Return ``name`` if it names a schedule of :data:`SCHEDULES`.

    Raises:
        ValueError: any other value (the message lists the choices).
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        choices = ", ".join(repr(n) for n in SCHEDULES)
        raise ValueError(f"schedule must be one of {choices} (schedule: {name!r})")
    return name
