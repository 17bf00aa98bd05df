"""The stage's own random stream: what a stage's layers draw leaves the process's generators alone.

Every rank of a pipeline runs the user's code (the DataLoader, ``training_step``) and must draw the
same numbers there: a shuffling loader draws its permutation's seed from ``torch``'s global
generator at each epoch, and the first stage's inputs and the last stage's targets come from the
same batch only if every stage draws the same seed. But each stage runs only its own layers: a
dropout on one stage draws where the others do not (and once per micro-batch, where one device
draws once per batch), so with the layers on the global generator the ranks' generators part at
the first random layer, and from the next epoch on the stages would train on different samples
(silently: the inputs of one, the targets of another).

So a stage's layers draw from the stage's own stream (:class:`StageGenerator`): ``torch``'s CPU
generator and the stage device's, swapped in around each micro-batch's forward and out after it.
At the stage's first forward, every rank of a pipeline holds the same state (rank 0's:
:func:`share_rng_state`, and the same user code ran since); a number
``base = torch.randint(2**62, (1,))`` is drawn from it and put back, and stage ``k``'s streams are
``torch.Generator(device).manual_seed(base + k)``: each stage's differ (as one device's layers draw
different masks; one state for all stages would give stage 0's and stage 1's dropouts the same
masks), and only the stage's layers advance them. What holds for random layers: a stage's masks
equal those of one device running the same micro-batches through that stage's layers in turn from
its stream; a recompute replays the forward's masks
(``torch.utils.checkpoint`` stashes the stream's state with the forward); Python's ``random`` and
NumPy's generators are not swapped (layers rarely draw from them).

One call per micro-batch (every schedule but ``"gpipe"``) has one more stream: the user's code
after the pipelined call runs on the last stage only, so there its draws come from the last
stage's after-call stream (seeded ``base + K``), entered when the call returns and left when
``training_step`` does; what every stage runs, the code before the call, draws the same numbers on
every stage from the process's generators. (Under ``"gpipe"`` the last stage's generator state
reaches the other stages with the step outcome instead, :mod:`lightning_gpipe.engine.outcome`, so those
draws are one device's.)

**Rank 0's state.** A seeded script run on one device draws its shuffled batches from the global
generators in the state the script left them. Every rank here runs the same script, but only rank
0 (the process the user started) is guaranteed to have run it exactly as on one device, so
:func:`share_rng_state` gives every rank rank 0's generator states when the processes connect,
without re-seeding (which a one-device run never does): a shuffling ``DataLoader`` then draws the
same permutation on every stage of every pipeline as the script would on one device.

Cost: two copies of each generator's state per micro-batch forward (the CPU generator's is 5 056
bytes).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StageGenerator", "share_rng_state"]

# Stages run as threads of one process (the tests' in-process transport) take turns at the process's
# generators: torch's get and set of a generator's state hold the GIL while they wait for the
# generator's lock, and two threads doing so at once were seen to wait on each other for good.
_TURNS = threading.Lock()


class StageGenerator:
    """A stage's random stream on ``device`` (and the CPU): :meth:`drawing` runs code on it.

    Args:
        device: the stage's device; its generator is swapped too when it is not the CPU.
        stage: the stage's index k (its streams are seeded ``base + k``).
    """

    def __init__(self, device: torch.device, stage: int = 0) -> None:
        self.device = device
        self.stage = stage
        self._states: tuple[Tensor, Tensor | None] | None = None  # the stream, once started
        self._outer: tuple[Tensor, Tensor | None] | None = None  # the process's, while entered

    def _get(self) -> tuple[Tensor, Tensor | None]:
        on_device = self.device.type != "cpu" and hasattr(torch, self.device.type)
        with _TURNS:
            device_state = getattr(torch, self.device.type).get_rng_state(self.device) if on_device else None
            return torch.get_rng_state(), device_state

    def _set(self, states: tuple[Tensor, Tensor | None]) -> None:
        cpu, device_state = states
        with _TURNS:
            torch.set_rng_state(cpu)
            if device_state is not None:
                getattr(torch, self.device.type).set_rng_state(device_state, self.device)

    def _start(self) -> tuple[Tensor, Tensor | None]:
        """The stage's streams, seeded ``base + k`` from a number drawn from the process's CPU
        generator (the caller puts its state back)."""
        seed = int(torch.randint(2**62, (1,))) + self.stage
        on_device = self.device.type != "cpu" and hasattr(torch, self.device.type)
        device_state = torch.Generator(self.device).manual_seed(seed).get_state() if on_device else None
        return torch.Generator().manual_seed(seed).get_state(), device_state

    def enter(self) -> None:
        """From here the process's generators hold the stream (started on first use), until :meth:`leave`."""
        if self._outer is not None:
            return
        self._outer = self._get()
        if self._states is None:
            self._states = self._start()
        self._set(self._states)

    def leave(self) -> None:
        """Keep the stream as the code left it and put the process's generators back as :meth:`enter`
        found them (nothing when not entered)."""
        if self._outer is None:
            return
        self._states = self._get()
        outer, self._outer = self._outer, None
        self._set(outer)

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Within: the process's generators hold the stream (:meth:`enter`); after: as on entry
        (:meth:`leave`)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()


def share_rng_state(rank: int) -> None:
    """Set this process's ``torch`` (CPU), ``random`` and ``numpy`` generators to global rank 0's states.

    A collective over the default group: every rank calls it.
    """
    box = [(torch.get_rng_state(), random.getstate(), np.random.get_state()) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    torch_state, python_state, numpy_state = box[0]
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
