"""Interleaved 1F1B (virtual stages) as data: literal grids, Megatron-LM's order, parts, validation
(messages: test_schedule_messages.py)."""

import pytest

from lightning_gpipe.schedule import (
    SCHEDULES,
    Action,
    bubble_share,
    fill_drain,
    format_grid,
    holder,
    ideal_bubble,
    interleaved_1f1b,
    one_f_one_b,
    part,
    place,
    stage_actions,
    validate,
    virtual_stages_of,
)

EXPECTED_K2_V2_M4 = """\
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
  17  B3v0    ."""


def _a(text: str) -> Action:
    """``"F2v1"`` -> Action("F", 2, 1); ``"B0"`` -> Action("B", 0)."""
    i, _, u = text[1:].partition("v")
    return Action(text[0], int(i), int(u or 0))  # type: ignore[arg-type]


def test_interleaved_k2_v2_m4_is_megatron_table():
    """Megatron-LM, K=2 (pipeline ranks), v=2 (model chunks), M=4, worked by hand from its code.

    Forward k of 8 runs model chunk ``(k mod (K·v)) // K`` on micro-batch ``(k // (K·v))·K + k mod K``;
    backward k runs chunk ``v-1`` minus that. Warm-up: ``2(K-1-rank) + (v-1)·K`` forwards (4 on
    rank 0, 2 on rank 1), then one forward and one backward, then the rest of the backwards.
    """
    grid = interleaved_1f1b(2, 4, 2)
    assert format_grid(grid) == EXPECTED_K2_V2_M4
    stage0 = "F0 F1 F0v1 F1v1 F2 B0v1 F3 B1v1 F2v1 B0 F3v1 B1 B2v1 B3v1 B2 B3"
    stage1 = "F0 F1 F0v1 B0v1 F1v1 B1v1 F2 B0 F3 B1 F2v1 B2v1 F3v1 B3v1 B2 B3"
    assert stage_actions(grid, 0) == [_a(x) for x in stage0.split()]
    assert stage_actions(grid, 1) == [_a(x) for x in stage1.split()]
    assert virtual_stages_of(grid) == 2
    validate(grid)
    assert bubble_share(grid) == pytest.approx(ideal_bubble(2, 4, 2)) == pytest.approx(1 / 9)


def _megatron_columns(k: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's ``forward_backward_pipelining_with_interleaving`` order, for ``M mod K = 0``."""
    total = m * v

    def chunk(n: int, forward: bool) -> int:  # get_model_chunk_id
        c = (n % (k * v)) // k
        return c if forward else v - 1 - c

    def microbatch(n: int) -> int:  # get_microbatch_id_in_model_chunk
        return (n // (k * v)) * k + n % k

    columns = []
    for rank in range(k):
        warmup = min(2 * (k - rank - 1) + (v - 1) * k, total)
        f = [Action("F", microbatch(n), chunk(n, True)) for n in range(total)]
        b = [Action("B", microbatch(n), chunk(n, False)) for n in range(total)]
        column = f[:warmup]
        for n in range(total - warmup):
            column += [f[warmup + n], b[n]]
        columns.append(column + b[total - warmup :])
    return columns


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_columns_are_megatron_when_k_divides_m(k, v, groups):
    m = k * groups
    grid = interleaved_1f1b(k, m, v)
    assert [stage_actions(grid, j) for j in range(k)] == _megatron_columns(k, m, v)
    validate(grid)
    assert bubble_share(grid) == pytest.approx(ideal_bubble(k, m, v))


def _one_f_one_b_columns(k: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: stage j warms up with min(K-1-j, M) forwards, then 1F1B, then the rest."""
    columns = []
    for j in range(k):
        w = min(k - 1 - j, m)
        column = [Action("F", i) for i in range(w)]
        for i in range(m - w):
            column += [Action("F", w + i), Action("B", i)]
        columns.append(column + [Action("B", i) for i in range(m - w, m)])
    return columns


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_one_virtual_stage_is_plain_one_f_one_b(k, m):
    grid = interleaved_1f1b(k, m, 1)
    assert grid == one_f_one_b(k, m)
    assert [stage_actions(grid, j) for j in range(k)] == _one_f_one_b_columns(k, m)
    validate(grid)
    assert bubble_share(grid) == pytest.approx(ideal_bubble(k, m))
    for j in range(k):  # 1F1B bounds the micro-batches in flight on stage j by K - j
        held = peak = 0
        for action in stage_actions(grid, j):
            held += 1 if action.kind == "F" else -1
            peak = max(peak, held)
        assert peak == min(k - j, m)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("v", [1, 2, 3])
def test_every_interleaved_grid_is_valid_and_its_bubble_near_ideal(k, m, v):
    if k == 1 and v > 1:
        with pytest.raises(ValueError, match=r"two or more pipeline stages \(stages: 1, virtual_stages: "):
            interleaved_1f1b(k, m, v)
        return
    grid = interleaved_1f1b(k, m, v)
    validate(grid)
    assert virtual_stages_of(grid) == v
    assert all(len(stage_actions(grid, j)) == 2 * m * v for j in range(k))
    if m >= k:  # with fewer micro-batches than stages no schedule fills the pipeline
        assert bubble_share(grid) <= ideal_bubble(k, m, v) + 0.02
    if v > 1 and m >= k:  # interleaving shrinks the bubble against plain 1F1B
        assert bubble_share(grid) < bubble_share(interleaved_1f1b(k, m, 1))


def test_in_flight_forwards_do_not_grow_with_micro_batches():
    """Interleaving keeps 1F1B's property: a stage's forwards in flight are bounded independently of M."""
    for k, v in [(2, 2), (3, 2), (4, 3)]:
        peaks = []
        for m in (k, 2 * k, 4 * k, 8 * k):
            grid = interleaved_1f1b(k, m, v)
            held = peak = 0
            for action in stage_actions(grid, 0):
                held += 1 if action.kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        assert peaks[1] == peaks[2] == peaks[3] <= 2 * (k - 1) + v * k, (k, v, peaks)


def test_parts_and_places():
    assert [part(j, u, 3) for u in range(2) for j in range(3)] == [0, 1, 2, 3, 4, 5]
    assert [holder(c, 3) for c in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_validate_names_parts_across_virtual_stages():
    grid = interleaved_1f1b(2, 4, 2)
    late = [list(row) for row in grid]
    late[2][0], late[4][0] = late[4][0], late[2][0]  # F0v1 (part 2) after F0v1 (part 3) needs it
    with pytest.raises(
        ValueError, match=r"F0 on part 3 \(stage 1, virtual stage 1\) runs before its input from part 2"
    ):
        validate(late)
    broken = [list(row) for row in grid]
    broken[3][1] = None  # stage 1 never runs F0v1 (part 3)
    with pytest.raises(ValueError, match=r"part 3 \(stage 1, virtual stage 1\) never runs F0"):
        validate(broken)
    early = [list(row) for row in grid]
    early[1][1], early[0][1] = None, early[1][1]  # F0 on part 1 at step 0, with part 0
    with pytest.raises(
        ValueError, match=r"F0 on part 1 \(stage 1, virtual stage 0\) runs before its input from part 0"
    ):
        validate(early)


def test_place_refuses_columns_that_wait_on_each_other_across_virtual_stages():
    columns = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match=r"wait on each other forever \(stage 0: B0, stage 1: B0\)"):
        place(columns)
    # stage 0's part 2 forward needs part 1's on stage 1, which comes after stage 1's own wait
    columns = [[Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0)],
               [Action("B", 0, 1), Action("F", 0), Action("F", 0, 1), Action("B", 0)]]  # fmt: skip
    with pytest.raises(ValueError, match=r"stage 0: F0v1, stage 1: B0v1"):
        place(columns)


def test_schedules_refuse_virtual_stages_they_cannot_run():
    with pytest.raises(
        ValueError, match=r"gpipe schedule runs one virtual stage per stage \(virtual_stages: 2\)"
    ):
        fill_drain(2, 4, 2)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer >= 1 \(virtual_stages: 0\)"):
        interleaved_1f1b(2, 4, 0)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer >= 1"):
        ideal_bubble(2, 4, 0)
    assert SCHEDULES["interleaved_1f1b"] is interleaved_1f1b


def test_ideal_bubble_with_virtual_stages_is_megatron_formula():
    # throughput K·M/(M + (K-1)/v) of one stage's: bubble ((K-1)/v) / (M + (K-1)/v)
    for k, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3)]:
        assert ideal_bubble(k, m, v) == pytest.approx(((k - 1) / v) / (m + (k - 1) / v))
    assert ideal_bubble(3, 4, 1) == ideal_bubble(3, 4)
