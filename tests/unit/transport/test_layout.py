"""Rank layout: W = K × D × T ranks, tensor rank t of stage s of replica d on rank (d·K + (K-1-s))·T + t."""

import itertools

import pytest

from lightning_gpipe.engine.skip import Route
from lightning_gpipe.transport.layout import Layout, check_pipeline_parallel_size


def test_rank_formula_puts_each_pipelines_last_stage_on_its_lowest_rank():
    layout = Layout(6, 3)
    assert (layout.stages, layout.replicas) == (3, 2)
    assert [[layout.rank(d, s) for s in range(3)] for d in range(2)] == [[2, 1, 0], [5, 4, 3]]
    assert layout.pipeline_ranks(1) == [5, 4, 3]
    assert layout.data_ranks(2) == [0, 3] and layout.data_ranks(0) == [2, 5]


@pytest.mark.parametrize(("world", "stages"), [(1, 1), (4, 4), (4, 2), (6, 3), (8, 1)])
def test_stage_and_replica_invert_the_rank_and_groups_partition_the_world(world, stages):
    layout = Layout(world, stages)
    for rank in range(world):
        assert layout.rank(layout.replica_of(rank), layout.stage_of(rank)) == rank
    pipelines = [r for d in range(layout.replicas) for r in layout.pipeline_ranks(d)]
    datas = [r for s in range(stages) for r in layout.data_ranks(s)]
    assert sorted(pipelines) == sorted(datas) == list(range(world))


def test_topology_names_neighbours_and_the_pipelines_ranks():
    layout = Layout(6, 3)
    skips = (Route("a", 0, 2),)
    middle = layout.topology(4, skips)  # replica 1, stage 1
    assert (middle.stage, middle.stages, middle.prev_rank, middle.next_rank) == (1, 3, 5, 3)
    assert middle.ranks == (5, 4, 3) and middle.skips == skips
    assert not middle.is_first and not middle.is_last
    first, last = layout.topology(5), layout.topology(3)
    assert first.is_first and first.prev_rank is None and first.next_rank == 4
    assert last.is_last and last.next_rank is None and last.prev_rank == 4
    alone = Layout(1, 1).topology(0)
    assert alone.is_first and alone.is_last and alone.ranks == (0,)


@pytest.mark.parametrize(("world", "stages"), [(3, 2), (4, 0), (2, 3)])
def test_world_not_a_multiple_of_the_stage_count_is_an_error(world, stages):
    with pytest.raises(ValueError, match=rf"world size: {world}, pipeline_parallel_size: {stages}"):
        Layout(world, stages)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_pipeline_parallel_size_must_be_a_positive_integer_or_none(bad):
    assert check_pipeline_parallel_size(None) is None and check_pipeline_parallel_size(3) == 3
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        check_pipeline_parallel_size(bad)


@pytest.mark.parametrize(
    ("world", "stages", "tensors"), [(1, 1, 1), (4, 2, 1), (6, 3, 1), (8, 2, 2), (12, 3, 2)]
)
def test_mesh_ranks_place_tensor_peers_adjacent_then_stages_then_replicas(world, stages, tensors):
    layout = Layout(world, stages, tensors)
    ranks = layout.mesh_ranks()
    k, d_, t_ = stages, layout.replicas, tensors
    assert (len(ranks), len(ranks[0]), len(ranks[0][0])) == (k, d_, t_)
    for p, d, t in itertools.product(range(k), range(d_), range(t_)):
        stage = k - 1 - p  # coordinate p along the pipeline counts from the last stage
        assert ranks[p][d][t] == (d * k + (k - 1 - stage)) * t_ + t  # the docstring's formula
        rank = ranks[p][d][t]
        assert (layout.stage_of(rank), layout.replica_of(rank), layout.tensor_of(rank)) == (stage, d, t)
        assert ranks[p][d] == layout.tensor_ranks(d, stage) == list(range(rank - t, rank - t + t_))
        assert [ranks[q][d][t] for q in range(k)] == sorted(layout.pipeline_ranks(d, t))
        assert [ranks[p][e][t] for e in range(d_)] == layout.data_ranks(stage, t)
    assert sorted(r for plane in ranks for row in plane for r in row) == list(range(world))
    assert ranks[k - 1][0][0] == layout.rank(0, 0) and layout.stage_of(0) == k - 1  # rank 0: a last stage


def test_a_replica_spans_contiguous_ranks_and_tensor_peers_share_a_node():
    layout = Layout(8, 2, 2)  # 2 nodes of 4: each replica (a pipeline of 2 stages × 2 TP ranks) on one node
    assert [layout.pipeline_ranks(d, t) for d in range(2) for t in range(2)] == [
        [2, 0],
        [3, 1],
        [6, 4],
        [7, 5],
    ]
    assert [layout.tensor_ranks(d, s) for d in range(2) for s in range(2)] == [[2, 3], [0, 1], [6, 7], [4, 5]]
    assert layout.data_ranks(1, 0) == [0, 4] and layout.topology(5).ranks == (7, 5)


def test_the_docs_picture_of_four_stages_times_two_replicas():
    """docs/lightning.md, "The device mesh": K = 4, D = 2, T = 1."""
    layout = Layout(8, 4)
    assert [layout.pipeline_ranks(d) for d in range(2)] == [[3, 2, 1, 0], [7, 6, 5, 4]]
    assert [layout.data_ranks(s) for s in range(4)] == [[3, 7], [2, 6], [1, 5], [0, 4]]
    assert [[p, d] for p in range(4) for d in range(2) if layout.mesh_ranks()[p][d] == [5]] == [[1, 1]]
    assert (layout.stage_of(5), layout.replica_of(5)) == (2, 1)
