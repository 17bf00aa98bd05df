"""The device mesh: pipeline × data × tensor parallel sizes, checked and inferred before any process
starts, and one :class:`~torch.distributed.device_mesh.DeviceMesh` over a rank's process groups (issue 42).

Sizes are checked at construction (:func:`check`) and against the world size when the
Trainer sets up the launcher (:func:`layout_of`), as ``pipeline_parallel_size`` always was: a bad
mesh fails before any process starts, naming the values and the fix.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_gpipe.transport.layout import Layout

__all__ = ["DATA_PARALLEL_MODES", "MESH_DIMS", "check", "device_mesh", "layout_of", "mesh_sizes"]

MESH_DIMS = ("pipeline_parallel", "data_parallel", "tensor_parallel")
"""The mesh's dimension names, outermost first (Lightning's names for the last two)."""

DATA_PARALLEL_MODES = ("replicate", "fsdp")


def _check_size(name: str, size: Any) -> int | None:
    if size is None or size == "auto":
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be an integer >= 1, 'auto' or None (got {size!r})")
    return size


def check(
    pipeline_parallel_size: Any, data_parallel_size: Any, tensor_parallel_size: Any, data_parallel: Any
) -> tuple[int | None, int | None, int | None, str]:
    """The mesh arguments, each size an integer ≥ 1 or ``None`` (``"auto"``: ``None``, inferred).

    Raises:
        ValueError: a size that is not an integer ≥ 1, ``"auto"`` or ``None``; ``data_parallel`` not
            one of :data:`DATA_PARALLEL_MODES`. ``tensor_parallel_size > 1`` needs the module's plan,
            checked with the module (:func:`lightning_gpipe.strategy.tensor_parallel.check_model`).
    """
    k = _check_size("pipeline_parallel_size", pipeline_parallel_size)
    d = _check_size("data_parallel_size", data_parallel_size)
    t = _check_size("tensor_parallel_size", tensor_parallel_size)
    if data_parallel not in DATA_PARALLEL_MODES:
        modes = ", ".join(map(repr, DATA_PARALLEL_MODES))
        raise ValueError(f"data_parallel must be one of {modes} (data_parallel: {data_parallel!r})")
    return k, d, t, data_parallel


def mesh_sizes(
    world_size: int, pipeline: int | None, data: int | None, tensor: int | None
) -> tuple[int, int, int]:
    """``(K, D, T)`` with ``K·D·T == world_size``, a size left out (``None``) inferred.

    ``T`` left out is 1. With both ``K`` and ``D`` left out, one pipeline spans the world
    (``K = W / T``, ``D = 1``); with one of them left out it is the world size over the others.

    Raises:
        ValueError: sizes whose product is not the world size, or that do not divide it; the message
            names the values and what to set.
    """
    w, t = world_size, tensor or 1
    sizes = zip(
        ("pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size"), (pipeline, data, tensor)
    )
    named = ", ".join(f"{name}: {size}" for name, size in sizes if size is not None)
    if pipeline is not None and data is not None:
        if pipeline * data * t != w:
            raise ValueError(
                f"pipeline_parallel_size × data_parallel_size × tensor_parallel_size must equal the world "
                f"size (devices × num_nodes): {pipeline} × {data} × {t} = {pipeline * data * t}, world size: "
                f"{w}; set devices × num_nodes to {pipeline * data * t}, or leave one size out to infer it"
            )
        return pipeline, data, t
    given = [s for s in (pipeline, data) if s is not None]
    known = t * (given[0] if given else 1)
    if w % known:
        raise ValueError(
            f"the world size must be a multiple of the sizes given (world size: {w}, {named}); set "
            f"devices × num_nodes to a multiple of {known}"
        )
    if pipeline is None and data is None:
        return w // t, 1, t
    if pipeline is None:
        return w // known, known // t, t
    return pipeline, w // known, t


def layout_of(world_size: int, pipeline: int | None, data: int | None, tensor: int | None) -> Layout:
    """The :class:`Layout` of the inferred sizes (:func:`mesh_sizes`; raises as it does)."""
    k, _, t = mesh_sizes(world_size, pipeline, data, tensor)
    return Layout(world_size, k, t)


def device_mesh(layout: Layout, device_type: str, pipeline: Any, data: Any, tensor: Any) -> DeviceMesh:
    """One rank's :class:`DeviceMesh` over its existing groups, dimensions :data:`MESH_DIMS`.

    The mesh holds the very groups given (``DeviceMesh.from_group``): ``mesh.get_group(name)`` is the
    rank's pipeline, data-parallel or tensor-parallel group. Coordinates follow
    :meth:`Layout.mesh_ranks` (along the pipeline, ``stage = K-1-coordinate``).

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (no index).
        pipeline, data, tensor: this rank's process groups of the three dimensions.
    """
    ranks = layout.mesh_ranks()
    return DeviceMesh.from_group([pipeline, data, tensor], device_type, mesh=ranks, mesh_dim_names=MESH_DIMS)
