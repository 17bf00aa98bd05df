"""Mesh sizes: K·D·T = W, a size left out inferred, bad meshes refused naming the values and the fix
(issue 42)."""

import re

import pytest

from lightning_gpipe.transport.mesh import check, layout_of, mesh_sizes


@pytest.mark.parametrize(
    ("world", "pipeline", "data", "tensor", "expected"),
    [
        (4, None, None, None, (4, 1, 1)),  # one pipeline over the world, as before the mesh
        (4, 2, None, None, (2, 2, 1)),
        (4, None, 2, None, (2, 2, 1)),
        (4, 1, None, None, (1, 4, 1)),
        (4, None, 4, None, (1, 4, 1)),
        (6, 3, 2, None, (3, 2, 1)),
        (6, 3, 2, 1, (3, 2, 1)),
        (8, 2, None, 2, (2, 2, 2)),
        (8, None, 2, 2, (2, 2, 2)),
        (8, None, None, 2, (4, 1, 2)),
        (1, None, None, None, (1, 1, 1)),
    ],
)
def test_sizes_multiply_to_the_world_and_the_missing_one_is_inferred(world, pipeline, data, tensor, expected):
    assert mesh_sizes(world, pipeline, data, tensor) == expected
    k, d, t = expected
    layout = layout_of(world, pipeline, data, tensor)
    assert (layout.stages, layout.replicas, layout.tensors) == (k, d, t) and k * d * t == world


@pytest.mark.parametrize(
    ("world", "sizes", "message"),
    [
        (8, (2, 2, 1), r"2 × 2 × 1 = 4, world size: 8; set devices × num_nodes to 4, or leave one size out"),
        (4, (2, 4, None), r"2 × 4 × 1 = 8, world size: 4; set devices × num_nodes to 8"),
        (
            3,
            (2, None, None),
            r"world size: 3, pipeline_parallel_size: 2\); set devices × num_nodes to a multiple",
        ),
        (
            6,
            (None, 4, None),
            r"world size: 6, data_parallel_size: 4\); set devices × num_nodes to a multiple of 4",
        ),
        (6, (None, None, 4), r"world size: 6, tensor_parallel_size: 4\); .* a multiple of 4"),
        (6, (3, None, 4), r"world size: 6, pipeline_parallel_size: 3, tensor_parallel_size: 4\); .* of 12"),
    ],
)
def test_sizes_that_do_not_fit_the_world_are_refused_naming_them(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        mesh_sizes(world, *sizes)


def test_check_keeps_good_sizes_and_reads_auto_as_left_out():
    assert check(2, None, None, "replicate") == (2, None, None, "replicate")
    assert check("auto", 2, 1, "replicate") == (None, 2, 1, "replicate")
    assert check(None, None, None, "replicate") == (None, None, None, "replicate")


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, 2.0, "2", True, [2]])
def test_a_size_that_is_not_a_positive_integer_is_refused(name, bad):
    sizes = {"pipeline_parallel_size": None, "data_parallel_size": None, "tensor_parallel_size": None}
    sizes[name] = bad
    with pytest.raises(
        ValueError, match=rf"{name} must be an integer >= 1, .auto. or None \(got {re.escape(repr(bad))}\)"
    ):
        check(*sizes.values(), "replicate")


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_sizes_are_kept(tensor, mode):
    """T > 1 is built (issue 42, item 3), with either data-parallel mode; the plan it needs is checked with
    the module (test_errors.py)."""
    assert check(2, None, tensor, mode) == (2, None, tensor, mode)


def test_fsdp_is_a_mode_and_an_unknown_mode_is_refused():
    assert check(2, 2, None, "fsdp") == (2, 2, None, "fsdp")
    with pytest.raises(
        ValueError, match=r"data_parallel must be one of 'replicate', 'fsdp' \(data_parallel: 'ddp'\)"
    ):
        check(2, 2, None, "ddp")
