"""ZB-H1 (lightning_gpipe.schedule.zero_bubble): the grid, the paper's rules, torch's columns, the
cost model."""

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

from lightning_gpipe.schedule import (
    SCHEDULES,
    Action,
    format_grid,
    one_f_one_b,
    place,
    stage_actions,
    validate,
    zb_h1,
)
from lightning_gpipe.tools.simulate import peak_activation_memory, simulate

EXPECTED_K3_M4 = """\
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
  13  W3      W3      W3"""


def test_zb_h1_grid_for_three_stages_and_four_micro_batches():
    grid = zb_h1(3, 4)
    validate(grid)
    assert format_grid(grid) == EXPECTED_K3_M4
    assert SCHEDULES["zb_h1"] is zb_h1


@pytest.mark.parametrize(("k", "m"), [(1, 3), (2, 1), (2, 3), (3, 4), (3, 8), (4, 8), (4, 2)])
def test_zb_h1_is_1f1b_with_each_w_held_back_j_backwards_on_stage_j(k, m):
    """Qi et al. 2024, section 3.1: without its W, each column is 1F1B's; W n-j follows B n on stage
    j (n >= j), the rest end the column, in micro-batch order."""
    grid = zb_h1(k, m)
    validate(grid)
    for j in range(k):
        column = stage_actions(grid, j)
        assert [a for a in column if a.kind != "W"] == stage_actions(one_f_one_b(k, m), j)
        assert [a.i for a in column if a.kind == "W"] == list(range(m))
        backwards = [a for a in column if a.kind == "B"]
        for n in range(j, m):
            assert column[column.index(backwards[n]) + 1] == Action("W", n - j), (k, m, j, n)


@pytest.mark.parametrize(("k", "m"), [(2, 1), (2, 3), (2, 4), (3, 4), (3, 8), (4, 8)])
def test_zb_h1_columns_are_torch_pipelinings_interleaved_zero_bubble_with_one_stage_per_rank(k, m):
    """The peer's action order per rank (``I``: our B), its idle steps dropped."""
    peer = ScheduleInterleavedZeroBubble.__new__(ScheduleInterleavedZeroBubble)
    peer.n_local_stages, peer.pp_group_size, peer._n_microbatches = 1, k, m
    peer.number_of_rounds = max(1, m // k)
    peer.microbatches_per_round = m // peer.number_of_rounds
    grid = zb_h1(k, m)
    for j in range(k):
        ops = [a for a in peer._calculate_single_rank_operations(j) if a is not None]
        theirs = [
            ("B" if a.computation_type.value == "I" else a.computation_type.value, a.microbatch_index)
            for a in ops
        ]
        assert [(a.kind, a.i) for a in stage_actions(grid, j)] == theirs, f"stage {j}"


def test_validate_refuses_a_weight_pass_before_its_backward():
    grid = place([[Action("F", 0), Action("B", 0), Action("W", 0)]])
    validate(grid)
    grid[1][0], grid[2][0] = grid[2][0], grid[1][0]
    with pytest.raises(ValueError, match="W0 on stage 0 runs before B0"):
        validate(grid)
    with pytest.raises(ValueError, match="virtual_stages: 2.*interleaved_1f1b"):
        zb_h1(2, 4, 2)


@pytest.mark.parametrize(("k", "m"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_k_minus_1_times_f_plus_b_minus_w(k, m):
    """F = B = W = 1 s: ZB-H1 takes M(F+B+W) + (K-1)(F+B-W), 1F1B M(F+B+W) + (K-1)(F+B+W) (Qi et al.
    2024, section 3.1 and table 2). A recomputed backward is not split: its W takes no time."""
    zb = simulate(k, m, 1.0, 2.0, schedule="zb_h1", checkpoint="never")
    assert zb.step_time == pytest.approx(m * 3 + (k - 1) * 1)
    assert simulate(k, m, 1.0, 2.0, schedule="1f1b", checkpoint="never").step_time == pytest.approx(
        (m + k - 1) * 3
    )
    # unequal parts of the backward: B 1.5 s, W 0.5 s
    uneven = simulate(k, m, 1.0, 2.0, schedule="zb_h1", checkpoint="never", weight_backward=0.5)
    assert uneven.step_time == pytest.approx(m * 3 + (k - 1) * 2)
    recomputed = simulate(k, m, 1.0, 2.0, schedule="zb_h1", checkpoint="always", timeline=True)
    assert all(e.end == e.start for stage in recomputed.timeline for e in stage if e.kind == "W")
    with pytest.raises(ValueError, match="weight_backward must not exceed backward"):
        simulate(k, m, 1.0, 2.0, schedule="zb_h1", weight_backward=3.0)


def test_zb_h1_holds_each_graph_until_its_w():
    """One sample per micro-batch, 1 byte each, checkpoint="never": stage j holds K-j micro-batches up
    to its B and j more up to their W, so every stage peaks at K (1F1B: K-j)."""
    assert peak_activation_memory(4, 8, 8, 1.0, checkpoint="never", schedule="zb_h1") == [4.0] * 4
    assert peak_activation_memory(4, 8, 8, 1.0, checkpoint="never", schedule="1f1b") == [4.0, 3.0, 2.0, 1.0]
    # recomputed: each backward whole at its B, freed there
    zb = peak_activation_memory(4, 8, 8, 1.0, 0.25, checkpoint="always", schedule="zb_h1")
    assert zb == peak_activation_memory(4, 8, 8, 1.0, 0.25, checkpoint="always", schedule="1f1b")


def test_the_strategy_warns_when_recompute_keeps_zb_h1_from_splitting():
    import warnings

    from lightning_gpipe import GPipeStrategy

    with pytest.warns(UserWarning, match=r"checkpoint='except_last'.*Use checkpoint='never'"):
        GPipeStrategy(schedule="zb_h1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GPipeStrategy(schedule="zb_h1", checkpoint="never").schedule == "zb_h1"
    with pytest.raises(ValueError, match=r"the zb_h1 schedule runs one virtual stage per stage"):
        GPipeStrategy(schedule="zb_h1", virtual_stages=2)
