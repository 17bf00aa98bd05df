"""1F1B schedules: :func:`one_f_one_b` (PipeDream-Flush) and :func:`interleaved_1f1b` (virtual stages).

Interleaved 1F1B for K=2, v=2, M=4 (stage 0 holds parts 0 and 2, stage 1 parts 1 and 3)::

    step  stage0  stage1
       0  F0v0    .
       1  F1v0    F0v0
       2  F0v1    F1v0
       3  F1v1    F0v1
       4  F2v0    B0v1
       5  B0v1    F1v1
       6  F3v0    B1v1
       7  B1v1    F2v0
       8  F2v1    B0v0
       9  B0v0    F3v0
      10  F3v1    B1v0
      11  B1v0    F2v1
      12  .       B2v1
      13  B2v1    F3v1
      14  .       B3v1
      15  B3v1    B2v0
      16  B2v0    B3v0
      17  B3v0    .

1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's non-interleaved schedule, Narayanan
et al. SC 2021, figure 4 top) for K=3, M=4, each action one clock step (:func:`one_f_one_b`)::

    step  stage0  stage1  stage2
       0  F0      .       .
       1  F1      F0      .
       2  F2      F1      F0
       3  .       .       B0
       4  .       B0      F1
       5  B0      F2      B1
       6  F3      B1      F2
       7  B1      F3      B2
       8  .       B2      F3
       9  B2      .       B3
      10  .       B3      .
      11  B3      .       .

Same length and bubble as fill-drain, but stage ``j`` holds at most ``min(K - j, M)`` micro-batches'
activations at once (fill-drain: ``M``).
"""

from __future__ import annotations

from lightning_gpipe.errors import check_count
from lightning_gpipe.schedule.grid import (
    Action,
    Grid,
    _check_counts,
    _check_one_virtual_stage,
    place,
)
from lightning_gpipe.schedule.grid import sizes as microbatch_sizes

__all__ = ["interleaved_1f1b", "one_f_one_b"]


def interleaved_1f1b(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
    """Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2): each stage holds ``v`` virtual stages.

    The model is cut into ``K·v`` parts; stage ``j`` holds parts ``j, j+K, …, j+(v-1)K`` as its
    virtual stages ``0 … v-1`` (:func:`part`), so a micro-batch passes through every stage ``v``
    times and the bubble shrinks to about ``(K-1)/(v·M+K-1)`` (:func:`ideal_bubble`). Each
    stage's column is Megatron-LM's (``forward_backward_pipelining_with_interleaving``,
    ``get_schedule_table`` / ``get_model_chunk_id``):

    - the micro-batches form groups (Megatron-LM's "microbatch group per virtual stage"), ``K``
      each when ``K`` divides ``M``; otherwise ``max(1, M // K)`` groups of near-equal sizes,
      larger first (``M = 5, K = 2``: 3 and 2; ``M < K``: one group of ``M``), which keeps the
      pipeline fed where Megatron-LM requires ``M mod K = 0``. A stage's forwards run group by
      group, within a group virtual stage by virtual stage, within that micro-batch by
      micro-batch; its backwards run in the same order with the virtual stages reversed (the
      last part's backward first);
    - stage ``j`` first runs ``min(2(K-1-j) + (v-1)·g, v·M)`` forwards (the warm-up; ``g`` the
      first group's size), then alternates one forward and one backward, then runs the
      backwards left. With ``v = 1`` it is :func:`one_f_one_b` (warm-up ``min(K-1-j, M)``).

    The backward of micro-batch ``i`` on the last part starts from micro-batch ``i``'s own loss,
    so the loss must exist per micro-batch (a stage's column interleaves forwards and backwards).
    The grid places each column's actions in order, each as early as its inputs allow (one step
    per action).

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1); any M, including ``M < K`` and ``M mod K ≠ 0``.
        virtual_stages: virtual stages per stage v (≥ 1; ≥ 2 needs ``K ≥ 2``).

    Raises:
        ValueError: a count below 1, or ``virtual_stages > 1`` with one stage.

    The grid for K=2, v=2, M=4 is in this module's docstring.
    """
    _check_counts(stages, chunks)
    check_count("virtual_stages", virtual_stages)
    if virtual_stages > 1 and stages == 1:
        raise ValueError(
            f"virtual stages need two or more pipeline stages (stages: {stages}, virtual_stages: "
            f"{virtual_stages}); use virtual_stages=1 or more stages"
        )
    if virtual_stages == 1:
        return one_f_one_b(stages, chunks)
    k, m, v = stages, chunks, virtual_stages
    groups = microbatch_sizes(m, max(1, m // k))
    starts = [sum(groups[:n]) for n in range(len(groups))]
    table = [  # Megatron-LM's schedule table: (micro-batch, virtual stage) in forward order
        (start + n, u) for start, size in zip(starts, groups) for u in range(v) for n in range(size)
    ]
    columns = []
    for j in range(k):
        warmup = min(2 * (k - 1 - j) + (v - 1) * groups[0], v * m)
        forwards = [Action("F", i, u) for i, u in table]
        backwards = [Action("B", i, v - 1 - u) for i, u in table]
        column = forwards[:warmup]
        for n in range(len(table) - warmup):
            column += [forwards[warmup + n], backwards[n]]
        columns.append(column + backwards[len(table) - warmup :])
    return place(columns)


def one_f_one_b(stages: int, chunks: int, virtual_stages: int = 1) -> Grid:
    """1F1B (PipeDream-Flush) as a ``step × stage`` grid, each action one clock step.

    Stage ``j`` of K runs ``w = min(K - 1 - j, M)`` warm-up forwards ``F0 … F(w-1)``, then
    alternates one forward and one backward (``F(w) B0 F(w+1) B1 …``) and ends with the remaining
    backwards, in micro-batch order: Megatron-LM's non-interleaved schedule (Narayanan et al.,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
    figure 4 top; PipeDream-Flush in Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
    Training", ICML 2021). Stage ``j`` has at most ``min(K - j, M)`` micro-batches forwarded and not
    yet backwarded; the grid has fill-drain's length ``2·(M + K - 1)`` and bubble.

    Args:
        stages: number of pipeline stages K (≥ 1).
        chunks: number of micro-batches M (≥ 1).
        virtual_stages: must be 1 (:func:`interleaved_1f1b` holds several per stage).

    Raises:
        ValueError: ``stages`` or ``chunks`` below 1, or ``virtual_stages`` other than 1.
    """
    _check_counts(stages, chunks)
    _check_one_virtual_stage("1f1b", virtual_stages)
    return place(_one_f_one_b_columns(stages, chunks))


def _one_f_one_b_columns(stages: int, chunks: int) -> list[list[Action]]:
    """1F1B's columns: warm-up forwards, one forward one backward, the remaining backwards."""
    columns = []
    for j in range(stages):
        warmup = min(stages - 1 - j, chunks)
        column = [Action("F", i) for i in range(warmup)]
        for i in range(chunks - warmup):
            column += [Action("F", warmup + i), Action("B", i)]
        column += [Action("B", i) for i in range(chunks - warmup, chunks)]
        columns.append(column)
    return columns
