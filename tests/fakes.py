"""In-process stand-ins for the transport and the timeline: K stages of a pipeline in one process.

:class:`FakeP2P` is the :class:`~lightning_gpipe.transport.p2p.P2P` interface over queues
(:class:`FakeNetwork`), every message encoded and decoded with the real header codec; sends never
block, so stages driven one after another in a valid order complete a fill-drain step.
:class:`ThreadP2P` runs over a :class:`BlockingNetwork` whose receives wait, for stages run in
threads (as processes would). :class:`Recorder` stands in for the timeline. :func:`micro_step`
drives one stage through a training step as the strategy does under a per-micro-batch schedule.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter, defaultdict, deque
from contextlib import contextmanager, nullcontext

import torch

from lightning_gpipe.schedule import POSTED_AHEAD
from lightning_gpipe.strategy.microstep import split_batch
from lightning_gpipe.transport.wire import decode_header, decode_message, encode_message

__all__ = [
    "BlockingNetwork",
    "FakeNetwork",
    "FakeP2P",
    "Recorder",
    "ThreadP2P",
    "TurnNetwork",
    "TurnP2P",
    "in_threads",
    "micro_step",
]


def _round_trip(tensors, structure, chunks, device):
    """A message as the receiver decodes it: the real header codec, the payload copied."""
    header, *payload = encode_message(tensors, structure, chunks, device)
    return decode_message(decode_header(header), [t.clone() for t in payload])


class FakeNetwork:
    """Queues between ranks; messages are encoded and decoded with the real header codec."""

    def __init__(self) -> None:
        self.queues: defaultdict[tuple[int, int], deque] = defaultdict(deque)


class FakeP2P:
    """The :class:`~lightning_gpipe.transport.p2p.P2P` interface over a :class:`FakeNetwork`.

    ``received`` counts the messages taken per source rank (:meth:`phase` hands them over);
    ``posted`` the receives posted (:meth:`post`) and not yet taken, never more than
    :data:`~lightning_gpipe.schedule.POSTED_AHEAD` + 1 from one source (as the real transport's
    rooms allow).
    """

    def __init__(self, network, rank: int) -> None:
        self.network, self.rank, self.device = network, rank, torch.device("cpu")
        self.received: Counter[int] = Counter()
        self.posted: Counter[int] = Counter()

    def send(self, tensors, dst, *, structure=None, chunks=0):
        self.network.queues[(self.rank, dst)].append(_round_trip(tensors, structure, chunks, self.device))

    def post(self, src):
        self.posted[src] += 1
        assert self.posted[src] <= POSTED_AHEAD + 1, f"rank {self.rank}: {self.posted[src]} posted from {src}"

    def recv(self, src):
        self.received[src] += 1
        if self.posted[src]:
            self.posted[src] -= 1
        return self._get(src)

    def _get(self, src):
        return self.network.queues[(src, self.rank)].popleft()

    def flush(self):
        """Nothing to wait for: a fake send completes as it is posted (receives may stay posted, as
        the step outcome's does across the column's flush)."""

    def settle(self):
        pass

    def phase(self) -> Counter:
        """The messages received per source rank since the last call (the count restarts)."""
        done, self.received = +self.received, Counter()
        return done


class BlockingNetwork:
    """Queues between ranks whose receives wait (stages run in threads, as processes would).

    A queue is made under a lock: a ``defaultdict(queue.Queue)`` read by the sender and the
    receiver at once can build two queues for one pair, and the receive then waits on the one
    nobody sends to.
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def queue(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())


class ThreadP2P(FakeP2P):
    """:class:`FakeP2P` over a :class:`BlockingNetwork`: a receive waits up to 20 s for its message."""

    def send(self, tensors, dst, *, structure=None, chunks=0):
        self.network.queue(self.rank, dst).put(_round_trip(tensors, structure, chunks, self.device))

    def _get(self, src):
        return self.network.queue(src, self.rank).get(timeout=20)


class TurnP2P(ThreadP2P):
    """:class:`ThreadP2P` whose stages take turns: a stage's thread holds ``network.turn`` (a lock)
    while it runs and lets go of it only while a receive waits, so no two stages compute at once
    (what a stage's layers draw from the process's generators stays the stage's)."""

    def _get(self, src):
        self.network.turn.release()
        try:
            return self.network.queue(src, self.rank).get(timeout=20)
        finally:
            self.network.turn.acquire()


class TurnNetwork(BlockingNetwork):
    """A :class:`BlockingNetwork` with the lock its stages take turns at (:class:`TurnP2P`)."""

    def __init__(self) -> None:
        super().__init__()
        self.turn = threading.Lock()


class Recorder:
    """Stands in for the timeline: keeps the forward and backward spans (with their virtual stage),
    in order, and (given the stage) the most micro-batches whose outputs the stage held at once."""

    def __init__(self, stage=None):
        self.actions, self.stage, self.peak_held = [], stage, 0

    @contextmanager
    def span(self, kind, i, u=0):
        if kind in ("forward", "backward"):  # as str(Action): F3, or F3v1 on virtual stage 1
            self.actions.append(f"{kind[0].upper()}{i}" + (f"v{u}" if u else ""))
        yield
        run = self.stage._run if self.stage is not None else None
        if run is not None:
            self.peak_held = max(self.peak_held, sum(1 for out in run.outputs.values() if out))


def recorded(column, stage: int) -> list[str]:
    """The forwards and backwards a :class:`Recorder` sees for ``stage``'s ``column`` (a list of
    :class:`~lightning_gpipe.schedule.Action`): the column without its ``W``s; but where the first
    stage's column has ``W``s, its ``B``s send nothing and each runs its whole backward at its
    ``W`` instead (as ``torch.distributed.pipelining`` runs it)."""
    if stage == 0 and any(a.kind == "W" for a in column):
        return [str(a) if a.kind == "F" else f"B{str(a)[1:]}" for a in column if a.kind != "B"]
    return [str(a) for a in column if a.kind != "W"]


def in_threads(stages, body, timeout: float = 60, turn: threading.Lock | None = None) -> None:
    """``body(stage)`` for every stage, each in its own thread (as processes would); errors re-raised
    (the first one), and a stage that never finishes is an error. With ``turn`` (a
    :class:`TurnNetwork`'s), each thread holds it while it runs (:class:`TurnP2P`)."""
    errors, finished = [], []

    def run(stage):
        try:
            if turn is not None:
                turn.acquire()
            try:
                body(stage)
            finally:
                if turn is not None:
                    turn.release()
            finished.append(stage)
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(stage,), daemon=True) for stage in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert len(finished) == len(stages), "a stage never finished its column"


def micro_step(stage, batch, training_step, chunks=None, around_outcome=None):
    """One training step of ``stage`` with one ``training_step`` call per micro-batch, as
    :class:`lightning_gpipe.strategy.microstep.MicroSteps` and the strategy's ``backward`` drive it.

    ``batch`` is split as the strategy splits it (:func:`~lightning_gpipe.strategy.microstep.split_batch`
    into ``chunks`` parts, default the stage's); the stage starts the step with each micro-batch's share
    of the batch ``w_i = n_i / N``; each part goes to ``training_step(part)`` (under
    :meth:`~lightning_gpipe.engine.stage.PipelineStage.run_step`), which calls the stage and, on the
    last stage, returns the part's loss; the last stage backpropagates ``w_i · loss_i`` and calls
    ``loss_backpropagated(i)``. Then ``end_micro_steps``, every stage's ``share_outcome`` of
    ``sum_i w_i · loss_i`` (inside ``around_outcome(stage)``, a context manager, where given: what a
    test checks as the outcome is shared) and Lightning's ``backward`` (the weight passes the last
    stage held).

    Returns:
        What ``share_outcome`` returned: on the last stage the step's loss (no graph), on the others
        the outcome's loss (a scalar that requires grad).
    """
    micro, parts = split_batch(batch, chunks or stage.chunks, stage.executor.min_micro_batch)
    weights = [n / sum(parts) for n in parts]
    stage.start_micro_steps(len(micro), weights)
    loss = None
    for i, part in enumerate(micro):
        out = stage.run_step(training_step, True, part)
        if stage.topology.is_last:
            weighted = out * weights[i]
            weighted.backward()
            stage.loss_backpropagated(i)
            loss = weighted.detach() if loss is None else loss + weighted.detach()
    stage.end_micro_steps()
    with around_outcome(stage) if around_outcome is not None else nullcontext():
        shared = stage.share_outcome(loss, None, training=True)
    assert shared is not None, f"stage {stage.topology.stage} shared no loss"
    stage.backward()
    return shared


class FakeSend:
    """A send's work that completes when ``done`` is set (raising ``error``, if set)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        completed = self.done.wait(10)
        if self.error is not None:
            raise self.error
        return completed
