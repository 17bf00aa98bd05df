"""DTensors between stages: a stage's output ``DTensor`` travels as its local tensor plus its placements, and
the next stage's layers receive the same ``DTensor`` over their own tensor-parallel mesh (issue 42, item 3).

Under tensor parallelism each (replica, tensor-parallel rank) pair runs its own pipeline
(:meth:`lightning_gpipe.transport.layout.Layout.topology`), so tensor-parallel rank ``t`` of stage ``j``
sends to rank ``t`` of stage ``j+1``: the local shard it holds is the one its peer's coordinate holds.
:func:`to_wire` replaces every ``DTensor`` of a value by a dict of plain leaves (:data:`MARK`: the
placements, the global shape and stride; ``"local"``: ``DTensor.to_local()``, which gradients flow
through); :func:`from_wire` rebuilds it with ``DTensor.from_local`` over the receiving stage's mesh, from
the received leaf, so the gradient of the received tensor is the local gradient the sender
backpropagates. Placements and global shape travel with every message, so uneven shards and micro-batches
of different sizes arrive exact. Plain tensors (a plan's ``use_local_output=True``, the default) travel as
they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map

from lightning_gpipe.errors import PipelineUsageError

__all__ = ["MARK", "from_wire", "to_wire"]

MARK = "__dtensor__"
"""The key of a travelling ``DTensor``'s dict; its value: the placements (``"S:<dim>"``, ``"R"``,
``"P:<op>"``)."""


def _encode(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S:{placement.dim}"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return f"P:{placement.reduce_op}"
    raise PipelineUsageError(
        f"a DTensor between stages has the placement {placement!r}; between stages the pipeline carries "
        "Shard(dim), Replicate() and Partial(op) placements: redistribute the stage's output to one of them"
    )


def _decode(code: str) -> Placement:
    kind, _, arg = code.partition(":")
    if kind == "S":
        return Shard(int(arg))
    if kind == "P":
        return Partial(arg)
    if kind == "R":
        return Replicate()
    raise ValueError(f"unknown placement {code!r} in a message's DTensor")


def _is_wire(node: Any) -> bool:
    return type(node) is dict and MARK in node


def to_wire(value: Any) -> Any:
    """``value`` with every ``DTensor`` replaced by ``{MARK: placements, "local": local tensor, "shape":
    global shape, "stride": global stride}``; a value without one is returned as it is.

    Raises:
        PipelineUsageError: a placement other than ``Shard``, ``Replicate`` or ``Partial``.
    """
    if isinstance(value, DTensor):
        return _wire(value)
    if not isinstance(value, (tuple, list, dict)):
        return value
    return tree_map(lambda leaf: _wire(leaf) if isinstance(leaf, DTensor) else leaf, value)


def _wire(t: DTensor) -> dict[str, Any]:
    return {
        MARK: [_encode(p) for p in t.placements],
        "local": t.to_local(),
        "shape": list(t.shape),
        "stride": list(t.stride()),
    }


def from_wire(value: Any, mesh: Any) -> Any:
    """Inverse of :func:`to_wire`: every ``DTensor`` dict rebuilt over ``mesh`` (this stage's
    tensor-parallel mesh) from its local tensor, which gradients then reach.

    Raises:
        PipelineUsageError: a ``DTensor`` arrived and ``mesh`` is ``None`` (this stage has no
            tensor-parallel mesh), or its placements do not fit ``mesh``.
    """
    if not isinstance(value, (tuple, list, dict)):
        return value

    def rebuild(leaf: Any) -> Any:
        if not _is_wire(leaf):
            return leaf
        placements = [_decode(code) for code in leaf[MARK]]
        if mesh is None or mesh.ndim != len(placements):
            where = "no tensor-parallel mesh" if mesh is None else f"a mesh of {mesh.ndim} dimension(s)"
            raise PipelineUsageError(
                f"a DTensor with placements {leaf[MARK]} arrived from the previous stage, but this stage has "
                f"{where}; DTensors travel between stages of GPipeStrategy(tensor_parallel_size=T) over its "
                "'tensor_parallel' mesh dimension: parallelize with device_mesh['tensor_parallel'], or "
                "return plain tensors (use_local_output=True)"
            )
        return DTensor.from_local(
            leaf["local"],
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(leaf["shape"]),
            stride=tuple(leaf["stride"]),
        )

    return tree_map(rebuild, value, is_leaf=_is_wire)
