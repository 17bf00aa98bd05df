"""Split a mini-batch into micro-batches along dim 0, and join them back: tensors and any pytree.

GPipe (Huang et al. 2019, section 2.2) splits the mini-batch of ``N`` samples into ``chunks``
micro-batches; here sizes differ by at most one when ``N`` is not divisible by ``chunks``, and
``N < chunks`` gives ``N`` micro-batches of one sample each, never an empty one.

What travels between layers (the pipeline's input, what a stage hands the next, the last stage's
output) is a tensor, a tuple of tensors, or any pytree (``torch.utils._pytree``): dicts, lists and
tuples, nested, whose leaves are tensors (any dtype the transport knows, with or without
gradients), ``None``, ``bool``, ``int``, ``float`` or ``str``. What is split and what is replicated:

- **The batch size** ``N`` is dim 0 of the first tensor leaf (tuple and list order, dict insertion
  order) that has a dimension and is not marked with :func:`no_chunk`.
- **Split**: a tensor leaf of the pipeline's input whose dim 0 equals ``N`` is cut along dim 0.
- **Replicated**: every other leaf (a ``(T, T)`` causal mask, a rotary ``(T, d)`` table, a 0-d
  tensor, a tensor marked with :func:`no_chunk`, every non-tensor) goes whole, the same object,
  to every micro-batch. When a table's first dimension happens to equal ``N`` (``T == N``), mark
  it: ``no_chunk(table)``.
- **Between stages** a tensor a layer returns stays replicated when it is a replicated input
  passed on unchanged (the same tensor), is marked with :func:`no_chunk`, or is 0-d; any other
  tensor belongs to its micro-batch.
- **Join** (the last stage's output): per-micro-batch tensors are concatenated along dim 0;
  replicated tensors and non-tensor leaves are taken once (they must agree between
  micro-batches). A replicated tensor's gradient is the sum of its micro-batches' gradients, as
  on one device.

:class:`Structure` records how a value is made of its tensors; the transport
(:mod:`lightning_gpipe.transport.wire`) carries it in the message header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe._compat import tree_flatten, tree_leaf_paths, tree_unflatten
from lightning_gpipe.errors import MicroBatchError, check_count
from lightning_gpipe.schedule import sizes
from lightning_gpipe.transport.structure import CONSTANTS, SLOT, TENSOR, TREE, TUPLE, Structure

__all__ = [
    "SLOT",
    "TENSOR",
    "TREE",
    "TUPLE",
    "MicroBatchError",
    "Structure",
    "as_tensors",
    "batch_size",
    "flatten",
    "gather",
    "join",
    "no_chunk",
    "scatter",
    "sizes",
    "split",
    "unflatten",
]

_MARK = "_lightning_gpipe_no_chunk"


def no_chunk(tensor: Tensor) -> Tensor:
    """Mark ``tensor`` to go whole to every micro-batch instead of being split along dim 0.

    Returns ``tensor`` itself (no copy), so one-device code is unchanged: use it where a tensor's
    first dimension could equal the batch size ``N`` without being the batch dimension (a
    ``(T, d)`` rotary table with ``T == N``), in the pipeline's input or in what a layer returns
    (fairscale's ``NoChunk``, without the wrapper). A marked tensor that requires grad gets the sum
    of its micro-batches' gradients.

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"no_chunk marks a tensor (got {type(tensor).__name__}); only tensors are ever split")
    setattr(tensor, _MARK, True)
    return tensor


def _marked(t: Tensor) -> bool:
    return getattr(t, _MARK, False) is True


def _replicated(t: Tensor, keep: Sequence[Tensor]) -> bool:
    return t.dim() == 0 or _marked(t) or any(t is k for k in keep)


def flatten(value: Any, what: str, keep: Sequence[Tensor] = ()) -> tuple[tuple[Tensor, ...], Structure]:
    """``value``'s tensors in order and its :class:`Structure`.

    Args:
        value: a tensor, a tuple of tensors, or a pytree of tensors and :data:`CONSTANTS`.
        what: how to name ``value`` in an error message.
        keep: the replicated tensors of the micro-batch's input: passed on unchanged, they stay
            replicated (so do 0-d tensors and tensors marked with :func:`no_chunk`).

    Raises:
        MicroBatchError: a leaf is neither a tensor nor one of :data:`CONSTANTS` (the message
            names its path in ``value``).
    """
    if isinstance(value, Tensor):
        return (value,), Structure(TENSOR, (_replicated(value, keep),))
    if type(value) is tuple and value and all(isinstance(t, Tensor) for t in value):
        return value, Structure(TUPLE, tuple(_replicated(t, keep) for t in value))
    leaves, spec = tree_flatten(value)
    tensors: list[Tensor] = []
    slots: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            tensors.append(leaf)
            slots.append(SLOT)
        elif type(leaf) in CONSTANTS:
            slots.append(leaf)
        else:
            raise _refused(value, what)
    whole = tuple(_replicated(t, keep) for t in tensors)
    return tuple(tensors), Structure(TREE, whole, spec, tuple(slots))


def _refused(value: Any, what: str) -> MicroBatchError:
    path, leaf = next(
        (p, x) for p, x in tree_leaf_paths(value) if not isinstance(x, Tensor) and type(x) not in CONSTANTS
    )
    return MicroBatchError(
        f"{what}{path} is a {type(leaf).__name__} ({_short(leaf)}); between layers the pipeline carries "
        "tensors, None, bool, int, float and str, in dicts, lists and tuples: pass its tensors and "
        "numbers instead (float(x), int(x), tensor fields), or keep the object on the module"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unflatten(structure: Structure, tensors: Sequence[Tensor]) -> Any:
    """Inverse of :func:`flatten`: the value ``structure`` describes, holding ``tensors``."""
    if structure.kind == TENSOR:
        return tensors[0]
    if structure.kind == TUPLE:
        return tuple(tensors)
    assert structure.spec is not None
    it = iter(tensors)
    return tree_unflatten([next(it) if leaf is SLOT else leaf for leaf in structure.leaves], structure.spec)


def tensor_paths(structure: Structure) -> list[str]:
    """The path of each tensor of ``structure`` in its value (``""`` for a lone tensor)."""
    return [path for path, leaf in tree_leaf_paths(structure.template()) if leaf is SLOT]


def batch_dim(tensors: Sequence[Tensor]) -> int | None:
    """``N``: dim 0 of the first tensor that has one and is not marked with :func:`no_chunk`
    (``None``: no such tensor)."""
    return next((t.shape[0] for t in tensors if t.dim() > 0 and not _marked(t)), None)


def is_split(t: Tensor, n: int) -> bool:
    """Whether ``t``, a tensor of a batch of ``n`` samples, is split along dim 0 (else it goes whole
    to every micro-batch): the split rule of the module docstring."""
    return t.dim() > 0 and not _marked(t) and t.shape[0] == n


def scatter(
    value: Any, chunks: int, what: str = "input of the pipelined nn.Sequential", min_size: int = 1
) -> tuple[list[tuple[Tensor, ...]], Structure]:
    """Split the pipeline's input into ``min(chunks, N)`` micro-batches (the module's split rule).

    Shapes: a split tensor ``(N, *)`` → ``min(chunks, N) × (≈N/chunks, *)``, sizes as
    :func:`sizes` (with ``min_size``: at most ``N // min_size`` micro-batches, at least one); a
    replicated tensor goes unchanged (the same object, no copy) to every micro-batch.

    Returns:
        ``(micro_batches, structure)``: each micro-batch's tensors, in :func:`flatten` order, and
        the structure they share (:func:`unflatten` rebuilds each micro-batch's value).

    Raises:
        ValueError: ``chunks < 1``.
        MicroBatchError: a leaf the pipeline cannot carry (see :func:`flatten`), no tensor with a
            batch dimension, or ``N`` is 0.
    """
    check_count("chunks", chunks)
    tensors, structure = flatten(value, what)
    n = batch_dim(tensors)
    if n is None:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensors"
        raise MicroBatchError(
            f"{what} has no tensor with a batch dimension to split into micro-batches (shapes: {shapes}); "
            "pass the batch as a tensor (N, *) not marked with no_chunk"
        )
    if n < 1:
        raise MicroBatchError(f"{what}: batch size is 0; the pipeline needs at least one sample")
    whole = tuple(not is_split(t, n) for t in tensors)
    m = len(sizes(n, chunks, min_size))
    parts = [(t,) * m if w else torch.tensor_split(t, m, dim=0) for t, w in zip(tensors, whole)]
    return [tuple(p[i] for p in parts) for i in range(m)], replace(structure, whole=whole)


def gather(
    outputs: Sequence[Sequence[Tensor]], structures: Sequence[Structure], what: str
) -> tuple[tuple[Tensor, ...], Structure]:
    """Join the last stage's micro-batch outputs into the mini-batch's (the module's join rule).

    Shapes: a per-micro-batch tensor ``M × (n_i, *)`` → ``(Σ n_i, *)``; a replicated tensor is
    micro-batch 0's.

    Returns:
        ``(tensors, structure)``: the joined tensors and the structure (:func:`unflatten`).

    Raises:
        MicroBatchError: the micro-batches' outputs differ in structure or in a non-tensor leaf,
            a replicated 0-d tensor differs between micro-batches (a value of the whole
            mini-batch, e.g. a mean, cannot be joined from micro-batches), or per-micro-batch
            tensors differ beyond dim 0.
    """
    first = structures[0]
    for i, s in enumerate(structures[1:], 1):
        if s != first:
            raise MicroBatchError(
                f"{what} differs between micro-batches 0 and {i} ({_difference(first, s)}); every "
                "micro-batch must give the same structure, the same non-tensor values and replicate the same "
                "tensors"
            )
    joined = []
    for k, whole in enumerate(first.whole):
        parts = [o[k] for o in outputs]
        if whole:
            _check_replicas(parts, first, k, what)
            joined.append(parts[0])
            continue
        if len(parts) == 1:  # one micro-batch per call (schedule="1f1b"): nothing to join, no copy
            joined.append(parts[0])
            continue
        try:
            joined.append(torch.cat(parts, dim=0))
        except RuntimeError as err:
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise MicroBatchError(
                f"{what}{tensor_paths(first)[k]}: micro-batch outputs cannot be concatenated along dim 0 "
                f"(shapes: {shapes}); return per-sample tensors (n_i, *) or mark a replicated one with "
                "no_chunk"
            ) from err
    return tuple(joined), first


def _check_replicas(parts: Sequence[Tensor], structure: Structure, k: int, what: str) -> None:
    """A replicated 0-d output must be the same in every micro-batch (a per-micro-batch mean is not)."""
    if parts[0].dim() != 0:
        return  # passed on unchanged or marked with no_chunk: one value by construction
    for i, p in enumerate(parts[1:], 1):
        if p is not parts[0] and not torch.equal(p, parts[0]):
            raise MicroBatchError(
                f"{what}{tensor_paths(structure)[k]} is a 0-d tensor that differs between micro-batches 0 "
                f"and {i} ({parts[0].item()} and {p.item()}); a value of the whole mini-batch (a mean, a "
                "sum) cannot be joined from micro-batches: return it per sample, shape (n_i, *), and reduce "
                "it in the step"
            )


def _difference(a: Structure, b: Structure) -> str:
    """Where two structures first differ, in words."""
    if a.kind != b.kind or a.spec != b.spec or len(a.whole) != len(b.whole):
        return f"structure {_short(a.template())} and {_short(b.template())}"
    if a.leaves != b.leaves:
        for (path, x), (_, y) in zip(tree_leaf_paths(a.template()), tree_leaf_paths(b.template())):
            if x != y and not (x is SLOT and y is SLOT):
                return f"at {path or 'the value'}: {x!r} and {y!r}"
    paths = tensor_paths(a)
    k = next(k for k, (x, y) in enumerate(zip(a.whole, b.whole)) if x != y)
    return f"the tensor at {paths[k] or 'the value'} is replicated in one and not in the other"


def as_tensors(batch: object, what: str = "pipeline input") -> tuple[tuple[Tensor, ...], bool]:
    """Normalise ``batch`` to a tuple of tensors (where only a tensor or a tuple of tensors will
    do: the profiled balance's sample; the pipeline itself takes any pytree, :func:`scatter`).

    Args:
        batch: a tensor, or a tuple/list of tensors.
        what: how to name the value in an error message.

    Returns:
        ``(tensors, is_tuple)``: the tensors, and whether ``batch`` was a tuple.

    Raises:
        MicroBatchError: ``batch`` is neither a tensor nor a non-empty tuple of tensors.
    """
    if isinstance(batch, Tensor):
        return (batch,), False
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, Tensor) for t in batch):
        return tuple(batch), True
    if isinstance(batch, (tuple, list)):
        kinds = ", ".join(type(t).__name__ for t in batch) or "empty"
        raise MicroBatchError(
            f"{what} must be a tensor or a tuple of tensors, got a {type(batch).__name__} of ({kinds}); "
            "return plain tensors from each layer of the pipelined nn.Sequential"
        )
    raise MicroBatchError(
        f"{what} must be a tensor or a tuple of tensors, got {type(batch).__name__}; "
        "pass tensors to the pipelined nn.Sequential"
    )


def batch_size(tensors: Sequence[Tensor], what: str = "pipeline input") -> int:
    """The common dim-0 size ``N`` of ``tensors``.

    Raises:
        MicroBatchError: a tensor is 0-dimensional, the sizes differ, or ``N`` is 0.
    """
    sizes = []
    for k, t in enumerate(tensors):
        if t.dim() == 0:
            raise MicroBatchError(f"{what}: tensor {k} is 0-dimensional; micro-batching needs a batch dim 0")
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise MicroBatchError(f"{what}: tensors disagree on the batch size (dim 0 sizes: {sizes})")
    if sizes[0] < 1:
        raise MicroBatchError(f"{what}: batch size is 0; the pipeline needs at least one sample")
    return sizes[0]


def split(tensors: Sequence[Tensor], chunks: int) -> list[tuple[Tensor, ...]]:
    """Split tensors of batch size ``N`` into ``min(chunks, N)`` micro-batches (:func:`scatter`).

    Shapes: each ``(N, *)`` → ``min(chunks, N) × (≈N/chunks, *)``; sizes differ by at most one,
    larger micro-batches first.

    Raises:
        ValueError: ``chunks < 1``.
        MicroBatchError: see :func:`batch_size`.
    """
    batch_size(tensors)
    return scatter(tuple(tensors), chunks)[0]


def join(micro_batches: Sequence[Sequence[Tensor]]) -> tuple[Tensor, ...]:
    """Concatenate micro-batches back along dim 0: ``M × (n_i, *)`` → ``(Σ n_i, *)``."""
    return tuple(torch.cat(ts, dim=0) for ts in zip(*micro_batches))
