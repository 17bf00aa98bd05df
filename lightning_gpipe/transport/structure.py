"""How a value between layers is made of its tensors: :class:`Structure`, carried in a message's header.

The engine builds it (:func:`lightning_gpipe.engine.microbatch.flatten`); the transport encodes it
(:mod:`lightning_gpipe.transport.wire`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpipe._compat import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["CONSTANTS", "SLOT", "TENSOR", "TREE", "TUPLE", "Structure"]

TENSOR, TUPLE, TREE = 0, 1, 2
"""The kinds of :class:`Structure`: one tensor, a tuple of tensors, any other pytree."""

CONSTANTS: tuple[type, ...] = (type(None), bool, int, float, str)
"""The non-tensor leaves a value between layers may hold (exact types)."""


class _Slot:
    """Where a tensor goes in a :class:`Structure`'s leaves."""

    def __repr__(self) -> str:
        return "<tensor>"


SLOT = _Slot()


@dataclass(frozen=True)
class Structure:
    """How a value between layers is made of its tensors (its tensors travel apart).

    Attributes:
        kind: :data:`TENSOR` (one tensor), :data:`TUPLE` (a tuple of tensors) or :data:`TREE`.
        whole: per tensor, in order: replicated to every micro-batch (``True``) or the
            micro-batch's own (``False``).
        spec: :data:`TREE`: the pytree's structure.
        leaves: :data:`TREE`: its leaves in order, :data:`SLOT` where a tensor goes.
    """

    kind: int
    whole: tuple[bool, ...]
    spec: TreeSpec | None = None
    leaves: tuple[Any, ...] = ()

    def template(self) -> Any:
        """The value with :data:`SLOT` in place of each tensor."""
        if self.kind != TREE:
            return SLOT if self.kind == TENSOR else tuple(SLOT for _ in self.whole)
        assert self.spec is not None
        return tree_unflatten(list(self.leaves), self.spec)

    @classmethod
    def of_template(cls, template: Any, whole: Sequence[bool]) -> Structure:
        """Inverse of :meth:`template` (``whole``: per tensor, as :attr:`whole`)."""
        leaves, spec = tree_flatten(template)
        return cls(TREE, tuple(whole), spec, tuple(leaves))
