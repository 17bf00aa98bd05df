"""The GPipe cost model against hand-computed schedules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_gpipe.engine.microbatch import sizes as microbatch_sizes
from lightning_gpipe.schedule import ideal_bubble
from lightning_gpipe.tools.simulate import Event, peak_activation_memory, simulate


def test_equal_stages_give_the_ideal_bubble_and_step_time():
    sim = simulate(4, 8, forward=1.0, backward=2.0, checkpoint="never")
    assert sim.bubble == pytest.approx(3 / 11)
    assert sim.step_time == pytest.approx((8 + 4 - 1) * (1.0 + 2.0))
    assert sim.busy == [8 * 3.0] * 4
    assert ideal_bubble(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_simulated_bubble_equals_ideal_bubble_for_equal_stages(stages, chunks):
    sim = simulate(stages, chunks, forward=0.5, backward=1.0, checkpoint="never")
    assert sim.bubble == pytest.approx(ideal_bubble(stages, chunks))


def test_one_stage_has_no_bubble():
    sim = simulate(1, 4, forward=1.0, backward=2.0, checkpoint="never")
    assert sim.bubble == 0.0
    assert sim.step_time == pytest.approx(12.0)
    assert ideal_bubble(1, 4) == 0.0


def test_unequal_stages_two_by_two_by_hand():
    # stage 0: f=1, b=2; stage 1: f=3, b=4
    # stage 0: F0 [0,1] F1 [1,2]                       B1 [11,13]          B0 [15,17]
    # stage 1:          F0 [1,4] F1 [4,7] B1 [7,11] B0 [11,15]
    sim = simulate(2, 2, forward=[1.0, 3.0], backward=[2.0, 4.0], checkpoint="never", timeline=True)
    assert sim.timeline == [
        [
            Event("F", 0, 0.0, 1.0),
            Event("F", 1, 1.0, 2.0),
            Event("B", 1, 11.0, 13.0),
            Event("B", 0, 15.0, 17.0),
        ],
        [
            Event("F", 0, 1.0, 4.0),
            Event("F", 1, 4.0, 7.0),
            Event("B", 1, 7.0, 11.0),
            Event("B", 0, 11.0, 15.0),
        ],
    ]
    assert sim.step_time == 17.0
    assert sim.busy == [6.0, 14.0]
    assert sim.bubble == pytest.approx(1 - 20 / 34)


def test_latency_delays_every_boundary_crossing_on_the_critical_path():
    # K=3, f=b=1: the first micro-batch crosses 2 boundaries forward, the gradient 2 back
    sim = simulate(3, 4, forward=1.0, backward=1.0, checkpoint="never", latency=0.25)
    assert sim.step_time == pytest.approx((4 + 3 - 1) * 2.0 + 2 * 2 * 0.25)


def test_bandwidth_bound_link_serializes_transfers():
    # 100 bytes at 50 B/s: 2 s per transfer, longer than the 1 s of compute.
    # forward arrivals at stage 1: 3, 5, 7 -> stage 1 ends its forwards at 8 and its
    # backwards at 9, 10, 11; gradients arrive at stage 0 at 11, 13, 15 -> step ends at 16
    sim = simulate(
        2,
        3,
        forward=1.0,
        backward=1.0,
        checkpoint="never",
        boundary_bytes=100.0,
        bandwidth=50.0,
        timeline=True,
    )
    assert sim.timeline is not None
    assert [e.start for e in sim.timeline[1] if e.kind == "F"] == [3.0, 5.0, 7.0]
    assert [e.start for e in sim.timeline[0] if e.kind == "B"] == [11.0, 13.0, 15.0]
    assert sim.step_time == 16.0


def test_recompute_adds_one_forward_to_each_checkpointed_backward():
    never = simulate(1, 2, forward=1.0, backward=2.0, checkpoint="never")
    except_last = simulate(1, 2, forward=1.0, backward=2.0, checkpoint="except_last", timeline=True)
    always = simulate(1, 2, forward=1.0, backward=2.0, checkpoint="always")
    assert never.step_time == 6.0
    assert except_last.step_time == 7.0  # micro-batch 0 only
    assert always.step_time == 8.0
    assert except_last.timeline == [
        [
            Event("F", 0, 0.0, 1.0),
            Event("F", 1, 1.0, 2.0),
            Event("B", 1, 2.0, 4.0),
            Event("R", 0, 4.0, 5.0),
            Event("B", 0, 5.0, 7.0),
        ]
    ]


def test_recompute_always_with_equal_stages_keeps_the_ideal_bubble():
    sim = simulate(4, 8, forward=1.0, backward=2.0, checkpoint="always")
    assert sim.step_time == pytest.approx(11 * (1.0 + 1.0 + 2.0))
    assert sim.bubble == pytest.approx(3 / 11)


def test_memory_without_recompute_holds_the_whole_mini_batch():
    # a_k bytes per sample, N = 16: N * a_k
    assert peak_activation_memory(2, 4, 16, [100.0, 50.0], [10.0, 5.0], "never") == [1600.0, 800.0]


def test_memory_with_recompute_holds_boundary_inputs_plus_one_microbatch():
    # N * b_k + (N / M) * a_k
    assert peak_activation_memory(2, 4, 16, [100.0, 50.0], [10.0, 5.0], "always") == [
        16 * 10 + 4 * 100,
        16 * 5 + 4 * 50,
    ]
    # the last micro-batch keeps its activations: (N - N/M) * b_k + (N/M) * a_k
    assert peak_activation_memory(1, 4, 16, 100.0, 10.0, "except_last") == [12 * 10 + 4 * 100]


def test_memory_estimate_through_simulate_and_with_fewer_samples_than_chunks():
    sim = simulate(
        2, 4, 1.0, 1.0, checkpoint="always", batch_size=16, activation_bytes=100.0, input_bytes=10.0
    )
    assert sim.peak_activation_bytes == [560.0, 560.0]
    assert simulate(2, 4, 1.0, 1.0).peak_activation_bytes is None
    # N = 2 < M = 4: two micro-batches of one sample
    assert microbatch_sizes(2, 4) == [1, 1]
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    few = simulate(
        1, 4, 1.0, 1.0, checkpoint="always", batch_size=2, activation_bytes=100.0, input_bytes=10.0
    )
    assert few.peak_activation_bytes == [2 * 10 + 1 * 100]
    assert few.step_time == 2 * (1.0 + 1.0 + 1.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"checkpoint": "sometimes"}, ValueError, "checkpoint"),
        ({"forward": [1.0, 2.0, 3.0]}, ValueError, "forward needs 2 values"),
        ({"backward": -1.0}, ValueError, "backward"),
        ({"forward": math.nan}, ValueError, "forward"),
        ({"bandwidth": 0.0}, ValueError, "bandwidth"),
        ({"latency": -0.1}, ValueError, "latency"),
        ({"boundary_bytes": [1.0, 2.0]}, ValueError, "boundary_bytes needs 1 values"),
        ({"stages": 0}, ValueError, "stages"),
        ({"chunks": 2.0}, TypeError, "chunks"),
        ({"batch_size": 0}, ValueError, "batch_size"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, match):
    arguments = {"stages": 2, "chunks": 2, "forward": 1.0, "backward": 1.0} | kwargs
    with pytest.raises(error, match=match):
        simulate(**arguments)


@settings(max_examples=100, deadline=None)
@given(
    times=st.lists(
        st.tuples(st.floats(0.01, 10.0), st.floats(0.01, 10.0)),
        min_size=1,
        max_size=5,
    ),
    chunks=st.integers(1, 8),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
)
def test_step_time_respects_the_critical_path_and_the_slowest_stage(times, chunks, checkpoint):
    forward = [f for f, _ in times]
    backward = [b for _, b in times]
    sim = simulate(len(times), chunks, forward, backward, checkpoint=checkpoint)
    slowest = max(chunks * (f + b) for f, b in times)
    one_microbatch = sum(f + b for f, b in times)
    assert sim.step_time >= slowest * (1 - 1e-12)
    assert sim.step_time >= one_microbatch * (1 - 1e-12)
    assert 0.0 <= sim.bubble < 1.0
