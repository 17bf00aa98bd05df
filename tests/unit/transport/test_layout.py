"""Rank layout: W = K × D ranks, stage s of replica d on rank d·K + (K-1-s)."""

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
