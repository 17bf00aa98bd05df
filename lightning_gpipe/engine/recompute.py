"""Re-materialization (GPipe section 2.3): which micro-batches recompute their forward, and how.

A recomputed micro-batch keeps only its stage input during the fill; its forward runs again under
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks in the recompute
equal those of the forward) when its backward is due. The recompute runs on the module state its
forward saw and changes nothing (BatchNorm running statistics, other buffers, attributes:
:class:`ForwardState`, which the stage applies through ``context``). torchgpipe
calls this module ``checkpoint.py``; here ``checkpoint=`` names the policy and saved files live in
:mod:`lightning_gpipe.state`.

**Without side effects**: a re-run forward sees, and leaves, the module state of the forward.

A recomputed micro-batch (``checkpoint="always"`` or ``"except_last"``) runs its stage's forward
twice: once in the forward fill, once in the backward drain (``torch.utils.checkpoint``). Besides
its output, a forward may change the module's state; without care, the recompute repeats those
changes and computes on state that later micro-batches have changed since. The state a forward can
change, and what happens to it here:

- **buffers** (``register_buffer``, persistent or not), changed in place (``self.seen += n``,
  BatchNorm's running statistics, spectral norm's ``u``/``v``) or replaced
  (``self.seen = self.seen + n``);
- **tensor attributes** (``self.cache = ...``), including torchmetrics metric states held by a
  layer;
- **every other attribute** that is not a module: numbers, strings, ``None`` (``self.calls += 1``,
  torchmetrics' ``_update_count``), containers of any kind and depth (``list``, ``dict``,
  ``set``, ``deque``, ``defaultdict``, ``{"a": [...]}``: ``self.sizes.append(n)``) and plain
  objects (``self.stats.n += 1``);
- the same state changed by **forward hooks and pre-hooks** registered on the layers (they run
  again in the recompute: weight norm and spectral norm compute the weight there).

:meth:`ForwardState.capture` records all of it before a micro-batch's forward: tensors are cloned,
other attributes deep-copied (``copy.deepcopy``, one memo for the stage, so objects shared by
layers stay shared; modules, parameters and tensors in a graph inside them are kept, not copied).
:meth:`ForwardState.replay` puts that record in the modules for the recompute and afterwards puts
back the objects it found: the recompute computes on the forward's state and changes only the
record, so every change happens exactly once per micro-batch, as without recompute, and the
recompute's arithmetic equals the forward's. :meth:`ForwardState.prune` drops
the copies of tensors that the forward fill did not change (most buffers), so they hold no memory
through the backward; their recompute copies them when it runs.

Not covered: random draws (``torch.utils.checkpoint`` replays the RNG state and leaves the global
generator as the forward left it), parameters changed in place (``nn.Embedding(max_norm=...)``
renormalizes rows idempotently; copying every parameter per micro-batch would cost the memory
recompute saves) objects outside the modules (a list a hook closes over): a hook can ask
:func:`recomputing` and skip such effects), and an attribute ``copy.deepcopy`` refuses (a lock, a
generator), which is kept by reference.

Memory and time: the bytes of the stage's buffers and tensor attributes per recomputed micro-batch,
during the forward fill; after it, only those the fill changed (for BatchNorm, ``2·C + 1`` numbers
per layer and micro-batch); and a deep copy of the other attributes per recomputed micro-batch,
kept through the backward (tensors inside containers included; those that require grad are kept,
not copied; a Hugging Face layer's shared ``config``: one copy). A layer that holds a large
object it never changes in forward can keep it outside the module.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = ["CHECKPOINT_MODES", "ForwardState", "check_mode", "recomputed", "recomputes", "recomputing", "run"]


CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")
"""``"always"``: every micro-batch; ``"except_last"``: all but the last (its backward comes first,
right after its forward, so keeping its activations costs nothing extra at the peak); ``"never"``."""


def check_mode(checkpoint: str) -> str:
    """Return ``checkpoint`` if it is one of :data:`CHECKPOINT_MODES`.

    Raises:
        ValueError: any other value.
    """
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint must be one of {', '.join(repr(m) for m in CHECKPOINT_MODES)} (checkpoint: "
            f"{checkpoint!r})"
        )
    return checkpoint


def recomputes(checkpoint: str, i: int, chunks: int) -> bool:
    """Whether micro-batch ``i`` of ``chunks`` is re-materialized under ``checkpoint`` (the one rule)."""
    return checkpoint == "always" or (checkpoint == "except_last" and i < chunks - 1)


def recomputed(checkpoint: str, chunks: int) -> list[bool]:
    """:func:`recomputes` for every micro-batch ``0 .. chunks-1``.

    Raises:
        ValueError: unknown ``checkpoint``.
    """
    check_mode(checkpoint)
    return [recomputes(checkpoint, i, chunks) for i in range(chunks)]


def run(
    fn: Callable[..., Any], *args: Any, context: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> Any:
    """``fn(*args)`` keeping only its inputs; the forward reruns, inside ``context()``, at backward time."""
    return torch_checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (nullcontext(), context()),
    )


_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # hooks, _parameters, _buffers, _modules, training ...
# torch's composable APIs (fully_shard) keep their state in the module's __dict__ under keys starting so:
# the wrapper's state, not the module's, kept as it is
_COMPOSABLE = "__composable_api_state_key"
_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_local = threading.local()


def recomputing() -> bool:
    """Whether this thread is re-running a forward for the backward (inside :meth:`ForwardState.replay`).

    A forward hook whose effect lives outside the module (appending to a list it closes over,
    printing, counting in a global) can return early when this is ``True``.
    """
    return getattr(_local, "depth", 0) > 0


@dataclass
class _Slot:
    """One piece of state: ``owner.<name>`` (``buffer``: ``owner._buffers[name]``) as captured."""

    owner: nn.Module
    name: str
    buffer: bool
    ref: Any  # the object found there
    copy: Any  # a clone (tensors), a deep copy (other objects) or ref itself
    pruned: bool = False  # a tensor unchanged by the forward fill: its copy is dropped

    def get(self) -> Any:
        return self.owner._buffers.get(self.name) if self.buffer else self.owner.__dict__.get(self.name)

    def put(self, value: Any) -> None:
        if self.buffer:
            self.owner._buffers[self.name] = value
        else:
            self.owner.__dict__[self.name] = value


def _all(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every module of ``modules`` and below, each once."""
    seen: dict[int, nn.Module] = {}
    for module in modules:
        for m in module.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _deep_copy(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` deep-copied with ``memo`` (what it maps stays as mapped: modules, parameters, the
    stage's cloned tensors); tensors that require grad inside it are kept, not copied (they may be
    in an autograd graph, which ``copy.deepcopy`` refuses); ``value`` itself where ``copy.deepcopy``
    refuses it (a lock, a generator), leaving ``memo`` as it was (an alias of a part of ``value``
    elsewhere gets no half-made copy)."""
    if id(value) in memo:
        return memo[id(value)]
    trial = dict(memo)
    for t in _tensors_in(value):
        if t.requires_grad:
            trial.setdefault(id(t), t)
    try:
        copied = copy.deepcopy(value, trial)
    except Exception:  # noqa: BLE001 # not copyable: kept by reference, as documented
        return value
    memo.update(trial)
    return copied


def _tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors held in ``value``: through containers and plain objects' attributes (not modules)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, (nn.Module, type, *_ATOMS)):
            continue
        seen.add(id(v))
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset, deque)):
            stack.extend(v)
        elif hasattr(v, "__dict__"):
            stack.extend(vars(v).values())


class ForwardState:
    """A stage's module state before one micro-batch's forward, to replay for its recompute.

    Use :meth:`capture` before the forward, :meth:`prune` after the whole forward fill, and
    :meth:`replay` around the recompute.
    """

    def __init__(self, slots: list[_Slot]) -> None:
        self._slots = slots

    @classmethod
    def capture(cls, modules: Iterable[nn.Module]) -> ForwardState:
        """Record the buffers and attributes of ``modules`` (each with its submodules; tensors cloned).

        A tensor or object held in several places (a buffer shared by two layers, one ``config``)
        is copied once, so the copies share as the originals do.
        """
        slots: list[_Slot] = []
        owners = _all(modules)
        # one memo: deepcopy keeps modules and parameters, and maps each tensor to its one clone
        memo: dict[int, Any] = {id(m): m for m in owners}
        memo.update((id(p), p) for m in owners for p in m._parameters.values() if p is not None)

        def copy_of(t: Tensor) -> Tensor:
            if id(t) not in memo:
                with torch.no_grad():
                    memo[id(t)] = t.detach().clone()
            return memo[id(t)]

        others: list[tuple[nn.Module, str, Any]] = []
        for owner in owners:
            for name, buf in owner._buffers.items():
                if buf is not None:
                    slots.append(_Slot(owner, name, True, buf, copy_of(buf)))
            for name, value in owner.__dict__.items():
                if name in _MODULE_INTERNALS or name.startswith(_COMPOSABLE) or isinstance(value, nn.Module):
                    continue
                if isinstance(value, Tensor):  # in an autograd graph: kept by reference
                    slots.append(
                        _Slot(owner, name, False, value, value if value.requires_grad else copy_of(value))
                    )
                elif isinstance(value, _ATOMS):
                    slots.append(_Slot(owner, name, False, value, value))
                else:
                    others.append((owner, name, value))
        for owner, name, value in others:  # after the tensors: a container holding a buffer holds its clone
            slots.append(_Slot(owner, name, False, value, _deep_copy(value, memo)))
        return cls(slots)

    def prune(self) -> None:
        """Drop the copies of tensors the forward fill left as they were (same object, equal values).

        Their recompute gets a fresh copy when it runs (the recompute must not change the original
        either: some in-place updates, such as BatchNorm's, leave no trace in ``Tensor._version``).
        """
        for s in self._slots:
            if (
                isinstance(s.copy, Tensor)
                and s.copy is not s.ref
                and s.get() is s.ref
                and torch.equal(s.ref, s.copy)
            ):
                s.copy, s.pruned = None, True

    @contextmanager
    def replay(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Within: the captured state (what the recompute must compute on). After: the state of
        ``modules`` found on entry, attributes and buffers the recompute added removed again.

        The captured copies are used once: a state replays one recompute.
        """
        found = [_State.of(owner) for owner in _all(modules)]
        fresh: dict[int, Tensor] = {}
        for s in self._slots:
            if s.pruned:  # pruned: unchanged since the forward, copied now
                if id(s.ref) not in fresh:
                    with torch.no_grad():
                        fresh[id(s.ref)] = s.ref.detach().clone()
                s.put(fresh[id(s.ref)])
            else:
                s.put(s.copy)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            yield
        finally:
            _local.depth -= 1
            for state in found:
                state.restore()
            self._slots = []


@dataclass
class _State:
    """What one module holds (attributes and buffers by reference), to put back."""

    owner: nn.Module
    attributes: dict[str, Any]
    buffers: dict[str, Any]

    @classmethod
    def of(cls, owner: nn.Module) -> _State:
        attributes = {k: v for k, v in owner.__dict__.items() if k not in _MODULE_INTERNALS}
        return cls(owner, attributes, dict(owner._buffers))

    def restore(self) -> None:
        held = self.owner.__dict__
        for name in [k for k in held if k not in _MODULE_INTERNALS and k not in self.attributes]:
            del held[name]
        held.update(self.attributes)
        self.owner._buffers.clear()
        self.owner._buffers.update(self.buffers)
