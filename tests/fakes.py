"""In-process fakes of the transport, shared by the unit tests: K stages in one process.

:class:`FakeP2P` over a :class:`FakeNetwork` (sends never block; the stages run one after the
other) and :class:`ThreadP2P` over a :class:`BlockingNetwork` (receives wait; each stage runs in its
own thread, as processes would). Messages are encoded and decoded with the real wire codec.
:func:`step` runs one training step with one call per step (fill-drain), :func:`micro_step` one
with one call per micro-batch under any schedule.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter, defaultdict, deque
from contextlib import contextmanager

import torch
from torch import nn

from lightning_gpipe.balance import uniform_balance
from lightning_gpipe.engine.microbatch import sizes
from lightning_gpipe.engine.stage import StageDone, build_stage
from lightning_gpipe.schedule import interleaved_1f1b
from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.wire import decode_header, decode_message, encode_message


class FakeNetwork:
    """Queues between ranks; messages are encoded and decoded with the real header codec."""

    def __init__(self) -> None:
        self.queues: defaultdict[tuple[int, int], deque] = defaultdict(deque)


class FakeP2P:
    """The :class:`~lightning_gpipe.transport.p2p.P2P` interface over a :class:`FakeNetwork`, checking announcements.

    Like the real transport, announcing from a rank whose earlier announcement is not all taken
    is an error. ``announced`` and ``received`` count messages per source rank.
    """

    def __init__(self, network: FakeNetwork, rank: int) -> None:
        self.network, self.rank, self.device = network, rank, torch.device("cpu")
        self.left: Counter[int] = Counter()  # announced messages not yet taken, per source
        self.announced: Counter[int] = Counter()
        self.received: Counter[int] = Counter()
        self.expects: list[tuple[int, int]] = []  # every announcement, in order

    def send(self, tensors, dst, *, structure=None, chunks=0):
        header, *payload = encode_message(tensors, structure, chunks, self.device)
        message = decode_message(decode_header(header), [t.clone() for t in payload])
        self.network.queues[(self.rank, dst)].append(message)

    def expect(self, src, messages):
        assert self.left[src] == 0, f"messages announced from rank {src} are still to be received"
        self.left[src] = messages
        self.announced[src] += messages
        self.expects.append((src, messages))

    def recv(self, src):
        if self.left[src]:
            self.left[src] -= 1
        self.received[src] += 1
        return self.network.queues[(src, self.rank)].popleft()

    def flush(self):
        pass

    def settle(self):
        pass

    def phase(self):
        """What this phase announced and received (counts reset); every announced message must be taken."""
        assert not +self.left, f"announced but never received: {+self.left}"
        done = (+self.announced, +self.received)
        self.announced, self.received = Counter(), Counter()
        return done


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


def _step(
    seq, balance, chunks, x, y, checkpoint="except_last", loss_fn=nn.functional.mse_loss, recorder=None
):
    """One training step of ``seq`` cut by ``balance`` into stages over a fake network.

    Returns the stages in stage order, the loss, and per stage ``(announced, received)`` per
    source rank in its forward phase and in its backward phase.
    """
    k, network = len(balance), FakeNetwork()
    stages = []
    for stage_index in range(k):
        rank = Layout(k, k).rank(0, stage_index)
        stage = build_stage(seq, balance, Layout(k, k), rank, chunks, checkpoint, torch.device("cpu"))
        stage.p2p, stage.timeline = FakeP2P(network, rank), (recorder or Recorder)()
        stages.append(stage)
    forward, backward = {}, {}
    out = None
    for stage in stages:
        result = stage.run_step(stage, True, x)
        assert (result is StageDone) == (not stage.topology.is_last)
        out = result if stage.topology.is_last else out
        forward[stage.topology.stage] = stage.p2p.phase()
    loss = loss_fn(out, y)
    for stage in reversed(stages):  # the last stage sends the loss message before the others take it
        assert stage.share_outcome(loss if stage.topology.is_last else None, None, training=True) is not None
        if not stage.topology.is_last:
            assert stage.p2p.phase() == (Counter(), Counter({stage.topology.ranks[-1]: 1}))  # unannounced
    loss.backward()
    for stage in reversed(stages):
        stage.backward()
        backward[stage.topology.stage] = stage.p2p.phase()
    return stages, loss, forward, backward


def _by_rank(topology, counts):
    return Counter({topology.ranks[stage]: n for stage, n in counts.items()})


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
        header, *payload = encode_message(tensors, structure, chunks, self.device)
        message = decode_message(decode_header(header), [t.clone() for t in payload])
        self.network.queue(self.rank, dst).put(message)

    def recv(self, src):
        if self.left[src]:
            self.left[src] -= 1
        self.received[src] += 1
        return self.network.queue(src, self.rank).get(timeout=20)


def _split(x, parts):
    """A tensor, or a tuple of tensors (each split alike), into micro-batches of ``parts`` samples."""
    if isinstance(x, torch.Tensor):
        return list(x.split(parts))
    return list(zip(*(t.split(parts) for t in x)))


def _micro_step(
    seq,
    balance,
    chunks,
    x,
    y,
    schedule,
    checkpoint="except_last",
    outcome=False,
    loss_fn=nn.functional.mse_loss,
):
    """One training step of ``seq`` with one call per micro-batch, each stage in its own thread.

    The last stage backpropagates each micro-batch's loss (``loss_fn``, default the mean squared
    error), weighted by its share of the batch, right after its call, as
    :mod:`lightning_gpipe.strategy.microstep` does; with ``outcome``, the stages then share the step
    outcome as the strategy has them do. ``balance`` with ``K·v`` entries under an interleaved
    schedule gives each stage ``v`` virtual stages. ``x`` is a tensor or a tuple of tensors.

    Returns the stages, per stage ``(announced, received)`` per source rank over the step, and the
    step's loss (the micro-batch losses weighted by their shares, summed).
    """
    k = len(balance) if schedule is not interleaved_1f1b else None
    if k is None:  # K·v parts: the number of stages is given by the caller through ``stages``
        raise TypeError("use micro_step_virtual for an interleaved schedule")
    return _run_micro(seq, balance, k, chunks, x, y, schedule, checkpoint, outcome, loss_fn)


def _run_micro(seq, balance, k, chunks, x, y, schedule, checkpoint, outcome, loss_fn):
    network = BlockingNetwork()
    n = y.shape[0]
    parts = sizes(n, chunks)
    xs, ys = _split(x, parts), y.split(parts)
    stages = []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(
            seq, balance, Layout(k, k), rank, chunks, checkpoint, torch.device("cpu"), schedule=schedule
        )
        stage.p2p, stage.timeline = ThreadP2P(network, rank), Recorder(stage)
        stage.outcome_follows = outcome
        stages.append(stage)
    counts, losses = {}, []

    def run(stage):
        stage.start_micro_steps(len(parts))
        loss = None
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            out = stage.run_step(stage, True, xi)
            if stage.topology.is_last:
                loss = loss_fn(out, yi) * len(yi) / n
                loss.backward()
                losses.append(loss.detach())
                stage.loss_backpropagated(i)
        stage.end_micro_steps()
        if outcome:
            assert stage.share_outcome(loss, None, training=True) is not None
        counts[stage.topology.stage] = stage.p2p.phase()

    in_threads(stages, run)
    assert len(counts) == k, "a stage never finished its column"
    return stages, counts, sum(losses)


def micro_step_virtual(seq, stages, virtual_stages, chunks, x, y, checkpoint="except_last", loss_fn=None):
    """:func:`micro_step` under ``interleaved_1f1b`` with ``virtual_stages`` parts per stage, ``seq``
    cut into ``stages·virtual_stages`` equal parts."""
    balance = uniform_balance(len(seq), stages * virtual_stages)
    return _run_micro(
        seq,
        balance,
        stages,
        chunks,
        x,
        y,
        interleaved_1f1b,
        checkpoint,
        False,
        loss_fn or nn.functional.mse_loss,
    )


def in_threads(stages, body):
    """``body(stage)`` for every stage, each in its own thread (as processes would); errors re-raised."""
    errors = []

    def run(stage):
        try:
            body(stage)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(stage,)) for stage in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _reference_grads(seq, x, y):
    seq.zero_grad()
    nn.functional.mse_loss(seq(x), y).backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    return grads


# The names the tests use.
step, micro_step, by_rank, reference_grads = _step, _micro_step, _by_rank, _reference_grads
