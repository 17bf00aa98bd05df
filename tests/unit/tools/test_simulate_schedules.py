"""The cost model plays every schedule: 1F1B and interleaved 1F1B against the grids and by hand."""

from __future__ import annotations

import pytest

from lightning_gpipe.schedule import SCHEDULES, ideal_bubble, interleaved_1f1b, stage_actions
from lightning_gpipe.tools.simulate import Event, peak_activation_memory, simulate


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(
    ("k", "m", "v"), [(1, 3, 1), (2, 4, 1), (3, 5, 1), (2, 4, 2), (2, 5, 2), (3, 6, 2), (4, 8, 3)]
)
def test_equal_times_play_each_schedule_on_its_grid_clock(name, k, m, v):
    """With every part's forward and backward 0.5 s (ZB-H1: B and W 0.5 s each) and free links, action n
    of a column starts at 0.5 s times its step in the grid: the simulator and the grid read the same
    columns."""
    try:
        grid = SCHEDULES[name](k, m, v)
    except ValueError:
        assert v > 1  # a schedule without virtual stages refuses them
        return
    split = any(a is not None and a.kind == "W" for row in grid for a in row)
    sim = simulate(
        k,
        m,
        0.5 * v,
        (1.0 if split else 0.5) * v,
        schedule=name,
        virtual_stages=v,
        checkpoint="never",
        timeline=True,
    )
    assert sim.timeline is not None
    for j in range(k):
        steps = [step for step, row in enumerate(grid) if row[j] is not None]
        actions = stage_actions(grid, j)
        assert [(e.kind, e.microbatch, e.virtual_stage) for e in sim.timeline[j]] == [
            (a.kind, a.i, a.virtual_stage) for a in actions
        ]
        assert [e.start for e in sim.timeline[j]] == [0.5 * step for step in steps]
    assert sim.step_time == 0.5 * len(grid)


@pytest.mark.parametrize(("k", "m"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_one_f_one_b_takes_as_long_as_fill_drain_with_equal_stages(k, m):
    gpipe = simulate(k, m, 1.0, 2.0, checkpoint="never")
    one_f_one_b = simulate(k, m, 1.0, 2.0, schedule="1f1b", checkpoint="never")
    assert one_f_one_b.step_time == pytest.approx(gpipe.step_time) == pytest.approx((m + k - 1) * 3.0)
    assert one_f_one_b.bubble == pytest.approx(ideal_bubble(k, m))


@pytest.mark.parametrize(("k", "m", "v"), [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 16, 2), (3, 9, 3)])
def test_interleaving_divides_the_bubble_by_v(k, m, v):
    sim = simulate(k, m, 1.0, 2.0, schedule="interleaved_1f1b", virtual_stages=v, checkpoint="never")
    assert sim.bubble == pytest.approx(ideal_bubble(k, m, v), abs=0.01)
    # throughput against one stage: K·M/(M + (K-1)/v), Narayanan et al. SC 2021 section 2.2.1
    one_stage = m * 3.0 * k  # the whole model on one device
    assert one_stage / sim.step_time == pytest.approx(k * m / (m + (k - 1) / v), rel=0.02)
    plain = simulate(k, m, 1.0, 2.0, schedule="1f1b", checkpoint="never")
    assert sim.step_time < plain.step_time


def test_interleaved_memory_by_hand_k2_v2_m4():
    """One sample per micro-batch, 2 bytes per sample per stage (1 per part), checkpoint="never".

    Stage 0 runs F0 F1 F0v1 F1v1 F2 (5 held) B0v1 F3 (5) …; stage 1 F0 F1 F0v1 (3) B0v1 F1v1 (3) ….
    Fill-drain holds all 4 micro-batches (8 bytes); 1F1B K-j of them (4 and 2).
    """
    args = (2, 4, 4, 2.0)
    interleaved = peak_activation_memory(
        *args, checkpoint="never", schedule="interleaved_1f1b", virtual_stages=2
    )
    assert interleaved == [5.0, 3.0]
    assert peak_activation_memory(*args, checkpoint="never") == [8.0, 8.0]
    assert peak_activation_memory(*args, checkpoint="never", schedule="1f1b") == [4.0, 2.0]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_one_f_one_b_memory_is_flat_in_micro_batches_and_fill_drain_grows(checkpoint):
    """Micro-batches of 8 samples, K = 2: M = 4, 8, 16 (the BENCHMARKS.md memory table's sizes)."""
    a, b = 100.0, 10.0
    gpipe, one_f_one_b, interleaved = [], [], []
    for m in (4, 8, 16):
        n = 8 * m
        gpipe.append(peak_activation_memory(2, m, n, a, b, checkpoint))
        one_f_one_b.append(peak_activation_memory(2, m, n, a, b, checkpoint, schedule="1f1b"))
        interleaved.append(
            peak_activation_memory(2, m, n, a, b, checkpoint, schedule="interleaved_1f1b", virtual_stages=2)
        )
    assert one_f_one_b[0] == one_f_one_b[1] == one_f_one_b[2]
    assert interleaved[0] == interleaved[1] == interleaved[2]
    for stage in range(2):
        assert gpipe[0][stage] < gpipe[1][stage] < gpipe[2][stage]
        assert one_f_one_b[2][stage] < gpipe[2][stage]
    if checkpoint == "never":  # K - j micro-batches of 8 samples in flight on stage j
        assert one_f_one_b[0] == [2 * 8 * a, 1 * 8 * a]
        assert gpipe[2] == [16 * 8 * a] * 2


def test_memory_of_a_recomputed_micro_batch_under_one_f_one_b_by_hand():
    """K = 1 (no pipeline), M = 2, one sample each, a = 100, b = 10, "always": F0 holds 10,
    B0 recomputes (10 + 100), F1 holds 10, B1 (10 + 100): 110."""
    assert peak_activation_memory(1, 2, 2, 100.0, 10.0, "always", schedule="1f1b") == [110.0]
    assert peak_activation_memory(1, 2, 2, 100.0, 10.0, "always") == [120.0]  # fill-drain: 10 + 10 + 100


def test_per_part_times_and_sizes():
    # K = 2, v = 2: parts 0..3 on stages 0, 1, 0, 1; part 3 is slow
    sim = simulate(
        2, 2, [1.0, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 3.0], schedule="interleaved_1f1b", virtual_stages=2,
        checkpoint="never", timeline=True,
    )  # fmt: skip
    assert sim.timeline is not None
    durations = {(e.kind, e.microbatch, e.virtual_stage): e.end - e.start for e in sim.timeline[1]}
    assert durations[("F", 0, 1)] == 3.0 and durations[("F", 0, 0)] == 1.0
    assert sim.busy == [2 * (1.0 + 1.0 + 1.0 + 1.0), 2 * (1.0 + 1.0 + 3.0 + 3.0)]
    with pytest.raises(
        ValueError, match=r"forward needs 2 values \(one per stage\) or 4 \(one per part\) \(got 3\)"
    ):
        simulate(2, 2, [1.0, 1.0, 1.0], 1.0, schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="boundary_bytes needs 3 values"):
        simulate(2, 2, 1.0, 1.0, schedule="interleaved_1f1b", virtual_stages=2, boundary_bytes=[1.0])
    # a stage's time split over its parts: forward 2 s per stage, 1 s per part
    halves = simulate(2, 2, 2.0, 2.0, schedule="interleaved_1f1b", virtual_stages=2, timeline=True)
    assert halves.timeline is not None
    assert {e.end - e.start for stage in halves.timeline for e in stage} == {1.0}


def test_links_carry_one_transfer_at_a_time_across_the_wrap():
    """K = 2, v = 2, 1 s per transfer: part 1 (stage 1) -> part 2 (stage 0) crosses the wrap link."""
    sim = simulate(
        2, 1, 2.0, 2.0, schedule="interleaved_1f1b", virtual_stages=2, checkpoint="never",
        bandwidth=1.0, boundary_bytes=1.0, timeline=True,
    )  # fmt: skip
    assert sim.timeline is not None
    # F0v0 [0,1] -> 1 s -> F0v0 on stage 1 [2,3] -> 1 s -> F0v1 on stage 0 [4,5] -> F0v1 on stage 1 [6,7]
    # B0v1 [7,8] -> B0v1 on stage 0 [9,10] -> B0v0 on stage 1 [11,12] -> B0v0 on stage 0 [13,14]
    assert sim.timeline[0] == [
        Event("F", 0, 0.0, 1.0, 0),
        Event("F", 0, 4.0, 5.0, 1),
        Event("B", 0, 9.0, 10.0, 1),
        Event("B", 0, 13.0, 14.0, 0),
    ]
    assert sim.step_time == 14.0


def test_unknown_schedule_and_unsupported_virtual_stages_are_refused():
    with pytest.raises(ValueError, match=r"unknown schedule \(schedule: 'zigzag'\)"):
        simulate(2, 2, 1.0, 1.0, schedule="zigzag")
    with pytest.raises(ValueError, match="gpipe schedule runs one virtual stage per stage"):
        simulate(2, 2, 1.0, 1.0, virtual_stages=2)
    with pytest.raises(TypeError, match="virtual_stages must be an integer >= 1"):
        simulate(2, 2, 1.0, 1.0, virtual_stages=2.0)  # type: ignore[arg-type]
    assert simulate(2, 4, 1.0, 1.0, schedule=interleaved_1f1b, virtual_stages=2).step_time > 0


def test_backward_workspace_and_loss_side_by_hand():
    """K = 2, M = 2, N = 4 (2 samples each), a = 100 / 50 per sample, "never"; workspace w = 7 / 3
    bytes, output o = 5 bytes per sample.

    1F1B: stage 0 runs F0 F1 B0 B1: 400 held when B0 starts, + w = 407. Stage 1 (last) runs
    F0 B0 F1 B1: 100 held + w 3 + one micro-batch's output and gradient 2·5·2 = 20: 123.
    Fill-drain: stage 0 407 again; stage 1 holds 200, and its loss saw the whole batch:
    200 + 3 + 2·5·4 = 243. With "always" (b = 10): stage 1 under 1F1B holds 20 at B0, which
    recomputes 100: 20 + 100 + 3 + 20 = 143.
    """
    extra = {"workspace_bytes": [7.0, 3.0], "output_bytes": 5.0}
    args = (2, 2, 4, [100.0, 50.0])
    assert peak_activation_memory(*args, checkpoint="never", schedule="1f1b", **extra) == [407.0, 123.0]
    assert peak_activation_memory(*args, checkpoint="never", **extra) == [407.0, 243.0]
    always = peak_activation_memory(*args, [10.0, 10.0], "always", schedule="1f1b", **extra)
    assert always[1] == 143.0
    # the defaults (0) keep the kept bytes alone
    assert peak_activation_memory(*args, checkpoint="never", schedule="1f1b") == [400.0, 100.0]
    sim = simulate(
        2,
        2,
        1.0,
        1.0,
        schedule="1f1b",
        checkpoint="never",
        batch_size=4,
        activation_bytes=[100.0, 50.0],
        **extra,
    )
    assert sim.peak_activation_bytes == [407.0, 123.0]


def test_backward_workspace_per_part_under_interleaving_by_hand():
    """K = 2, v = 2, M = 2, one sample each, 1 byte per sample per part, workspace 10, 20, 30, 40
    bytes on parts 0..3 (part 3, stage 1's second virtual stage, is last), output 5 bytes.

    Stage 0: F0v0 F1v0 F0v1 F1v1 hold 4, B0v1 (part 2) 4 + 30 = 34. Stage 1: F0v0 F1v0 F0v1 hold 3,
    B0v1 (part 3) 3 + 40 + 2·5·1 = 53; later B0v0 (part 1) 2 + 20 = 22.
    """
    peaks = peak_activation_memory(
        2,
        2,
        2,
        2.0,
        checkpoint="never",
        schedule="interleaved_1f1b",
        virtual_stages=2,
        workspace_bytes=[10.0, 20.0, 30.0, 40.0],
        output_bytes=5.0,
    )
    assert peaks == [34.0, 53.0]


@pytest.mark.parametrize(
    "extra", [{"workspace_bytes": -1.0}, {"output_bytes": -1.0}, {"workspace_bytes": [1.0] * 3}]
)
def test_backward_terms_are_checked(extra):
    with pytest.raises(ValueError, match="workspace_bytes|output_bytes"):
        peak_activation_memory(2, 2, 4, 1.0, schedule="1f1b", **extra)


def test_the_last_calls_loss_side_stays_alive_until_the_next_call():
    """Interleaved, K = 2, v = 2, M = 4, one sample each, nothing held but a workspace of 10 bytes
    on part 1 (stage 1's first virtual stage) and an output of 1 byte per sample. Stage 1 runs
    … F1v1 B1v1 F2v0 B0v0 …: while B0v0 runs, the loss side of micro-batch 1's call (its output
    and gradient, 2 bytes) is still alive: 10 + 2."""
    peaks = peak_activation_memory(
        2,
        4,
        4,
        0.0,
        checkpoint="never",
        schedule="interleaved_1f1b",
        virtual_stages=2,
        workspace_bytes=[0.0, 10.0, 0.0, 0.0],
        output_bytes=1.0,
    )
    assert peaks[1] == 12.0
