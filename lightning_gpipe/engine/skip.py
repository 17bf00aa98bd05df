"""Skip connections across stages: a layer stashes a tensor, a later layer pops it.

torchgpipe's idea (``torchgpipe.skip``: ``@skippable``, ``stash``, ``pop``): a U-Net's encoder
output must reach its decoder many layers later. Threading it through every layer in between
would make every stage in between receive and send it. Here :class:`Stash` wraps a layer whose
output is also kept under a name, and :class:`Pop` wraps a layer that takes that tensor as a
second input. Under the gpipe strategy the tensor travels point-to-point from the producing
stage straight to the consuming stage (and its gradient straight back); the stages in between
never see it. Without the strategy the same ``nn.Sequential`` runs on one device as written.

Example::

    model = nn.Sequential(
        Stash("enc", nn.Linear(6, 8)),      # output goes on, and is stashed as "enc"
        nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        Pop("enc"),                         # x + enc   (or Pop("enc", merge_module): merge(x, enc))
        nn.Linear(8, 3),
    )
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_gpipe.errors import SkipError


class _Store(dict):
    """The stashed tensors of one micro-batch (pipeline) or of the current forward (plain module)."""

    consume = True  # a plain forward pops what it takes; a micro-batch store keeps it for recompute

    def take(self, name: str) -> Tensor:
        if name not in self:
            raise SkipError(f"Pop({name!r}) ran before any Stash({name!r}) in this forward")
        return self.pop(name) if self.consume else self[name]


class MicroBatchStore(_Store):
    consume = False


_local = threading.local()


def current_store() -> _Store:
    store = getattr(_local, "store", None)
    if store is None:
        store = _local.store = _Store()
    return store


@contextmanager
def use_store(store: _Store) -> Iterator[None]:
    """Run layers with ``store`` as the place Stash writes to and Pop reads from."""
    previous = getattr(_local, "store", None)
    _local.store = store
    try:
        yield
    finally:
        _local.store = previous


class Stash(nn.Module):
    """Runs ``layer`` (default: identity); its output continues down the Sequential and is stashed
    as ``name``.

    Shapes: ``layer``'s own; the stashed tensor is the output (a tensor).
    """

    def __init__(self, name: str, layer: nn.Module | None = None) -> None:
        super().__init__()
        self.name = name
        self.layer = layer if layer is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        if not isinstance(y, Tensor):
            raise SkipError(
                f"Stash({self.name!r}) can only stash a tensor, its layer returned {type(y).__name__}"
            )
        current_store()[self.name] = y
        return y


class Pop(nn.Module):
    """Takes the tensor stashed as ``name`` and returns ``merge(x, stashed)`` (default: ``x + stashed``)."""

    def __init__(self, name: str, merge: nn.Module | None = None) -> None:
        super().__init__()
        self.name = name
        self.merge = merge

    def forward(self, x: Tensor) -> Tensor:
        skip = current_store().take(self.name)
        return self.merge(x, skip) if self.merge is not None else x + skip


@dataclass(frozen=True)
class Route:
    """Skip ``name`` is stashed by a layer of stage ``source`` and popped by a layer of stage ``target``."""

    name: str
    source: int
    target: int


def routes(sequential: nn.Sequential, layer_stage: list[int]) -> list[Route]:
    """Where each skip goes, from the layers' positions (``layer_stage[k]``: stage of layer ``k``).

    Raises:
        SkipError: a name stashed twice or popped twice, popped before it is stashed, or never popped.
    """
    stashed: dict[str, int] = {}
    popped: dict[str, int] = {}
    for k, layer in enumerate(sequential):
        for m in layer.modules():
            if isinstance(m, Pop):
                if m.name in popped:
                    raise SkipError(f"skip {m.name!r} is popped twice (layers {popped[m.name]} and {k})")
                if m.name not in stashed:
                    raise SkipError(f"skip {m.name!r} is popped by layer {k} before any layer stashes it")
                popped[m.name] = k
            if isinstance(m, Stash):
                if m.name in stashed:
                    raise SkipError(f"skip {m.name!r} is stashed twice (layers {stashed[m.name]} and {k})")
                stashed[m.name] = k
    never = sorted(set(stashed) - set(popped))
    if never:
        raise SkipError(f"skips stashed but never popped: {never}; add a Pop for each Stash")
    return sorted(
        (Route(name, layer_stage[stashed[name]], layer_stage[popped[name]]) for name in stashed),
        key=lambda r: r.name,
    )
