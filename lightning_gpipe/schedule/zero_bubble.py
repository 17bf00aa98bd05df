"""Zero-bubble schedules: :func:`zb_h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

ZB-H1 for K=3, M=4, each action one clock step (``B i``: the input gradient only; ``W i``: the
weight gradients)::

    step  stage0  stage1  stage2
       0  F0      .       .
       1  F1      F0      .
       2  F2      F1      F0
       3  .       .       B0
       4  .       B0      F1
       5  B0      F2      B1
       6  W0      B1      F2
       7  F3      W0      B2
       8  B1      F3      W0
       9  W1      B2      F3
      10  B2      W1      B3
      11  W2      B3      W1
      12  B3      W2      W2
      13  W3      W3      W3

Each action is one clock step here, a ``B`` and a ``W`` each as long as a forward. Played with
those times (:func:`lightning_gpipe.tools.simulate.simulate`, ``backward = B + W``), a step takes
``M(F+B+W) + (K-1)(F+B-W)`` against 1F1B's ``(M+K-1)(F+B+W)``: the gradient reaches each stage
before a ``W`` is computed, and the ``W`` fill the time the stage would wait.
"""

from __future__ import annotations

from lightning_gpipe.schedule.grid import Action, Grid, _check_counts, _check_one_virtual_stage, place

__all__ = ["zb_h1"]


def zb_h1(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B with each
    backward split into its input gradient (``B``) and its weight gradients (``W``), the ``W`` of
    stage ``j`` held back ``j`` backwards.

    Stage ``j`` of K runs 1F1B's column (:func:`~lightning_gpipe.schedule.one_f_one_b`: ``w =
    min(K-1-j, M)`` warm-up forwards, then one forward one backward, then the remaining backwards);
    after its ``n``-th backward ``B n`` it runs ``W (n-j)`` when ``n >= j``, and the ``W`` left at
    the end. The last stage, which the others wait on, sends each input gradient as soon as it is
    computed and defers its weight gradients to where it would idle; stage 0, which waits on no
    one, runs each ``W`` right after its ``B``. Bubble about ``(K-1)(F+B-W)`` against 1F1B's
    ``(K-1)(F+B+W)`` (``F``, ``B``, ``W``: the times of one micro-batch's forward, input gradient
    and weight gradients). A stage holds at most ``min(K-j, M)`` micro-batches forwarded and not
    yet through ``B``, and up to ``j`` more through ``B`` whose weight gradients are due (their
    graphs until ``W``). The column of each stage equals ``torch.distributed.pipelining``'s
    ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ``I`` is this ``B``).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).
        virtual_stages: must be 1.

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1, or ``virtual_stages`` other than 1.

    The grid for K=3, M=4 is in this module's docstring.
    """
    _check_counts(stages, chunks)
    _check_one_virtual_stage("zb_h1", virtual_stages)
    columns = []
    for j in range(stages):
        warmup = min(stages - 1 - j, chunks)
        column = [Action("F", i) for i in range(warmup)]
        for n in range(chunks):
            if warmup + n < chunks:
                column.append(Action("F", warmup + n))
            column.append(Action("B", n))
            if n >= j:
                column.append(Action("W", n - j))
        column += [Action("W", i) for i in range(max(0, chunks - j), chunks)]
        columns.append(column)
    return place(columns)
