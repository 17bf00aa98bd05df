"""One truth per step: what the last stage decided in a step reaches every stage before any hook runs.

Only the last stage of a pipeline runs the user's code after the pipelined call: the loss,
``self.log``, and any trainer state set there (``self.trainer.should_stop = True``). Lightning's
callbacks, LR schedulers (``ReduceLROnPlateau`` with ``interval="step"`` reads
``trainer.callback_metrics``) and the user's hooks run on every rank, right after the step. So
after every training, validation and test step, the last stage sends each other stage of its
pipeline a :class:`StepOutcome`: whether the step has a loss (and its value), ``should_stop``, and
``trainer.callback_metrics`` as they stand after the step, and the state of ``torch``'s CPU
generator. Each stage installs it before Lightning goes on (:func:`apply_outcome`), so
``on_train_batch_end``, schedulers and callbacks read the current step's values everywhere, and
every stage's generator stands where the last stage's does: what the user's code draws after the
pipelined call (a sampled loss, random targets) is drawn on the last stage only, and a shuffling
loader draws its next epoch's order from that generator on every stage (the stages' layers draw
from their own streams: :mod:`lightning_gpipe.engine.rng`).

Wire format: it rides on the message the stages already exchange after a training forward (the
loss message), one message per other stage and step: a float64 vector
``[has_loss, loss, should_stop, keys_follow, n, v_1 … v_n]`` (``8·(n + 5)`` bytes), the metric
values flattened in key order, and the generator's state (5 056 bytes), plus the transport's
512-byte header. The keys (names, dtypes,
shapes) travel as a second, uint8 message only when they change (the first step, a new logged
key), so a steady step costs no extra message. Validation and test steps have no loss message of
their own; they send the same one (``has_loss = 0``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.transport.p2p import P2P

_HEAD = 5  # has_loss, loss, should_stop, keys_follow, n


@dataclass
class StepOutcome:
    """What the last stage decided in one step.

    Attributes:
        has_loss: the step returned a loss (training steps; otherwise no stage runs a backward).
        loss: its value (a scalar loss; 0.0 otherwise).
        should_stop: ``trainer.should_stop`` after the step.
        metrics: ``trainer.callback_metrics`` after the step.
        rng: ``torch``'s CPU generator state after the step (``torch.get_rng_state()``).
    """

    has_loss: bool = False
    loss: float = 0.0
    should_stop: bool = False
    metrics: dict[str, Tensor] = field(default_factory=dict)
    rng: Tensor = field(default_factory=torch.get_rng_state)


def outcome_of(trainer: Any, out: Any) -> StepOutcome:
    """The last stage's outcome of the step that returned ``out`` (a loss, a dict with ``"loss"``,
    or None)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    has = isinstance(loss, Tensor)
    value = float(loss.detach().float()) if isinstance(loss, Tensor) and loss.numel() == 1 else 0.0
    metrics = dict(trainer.callback_metrics) if trainer is not None else {}
    stop = bool(trainer.should_stop) if trainer is not None else False
    metrics = {k: v for k, v in metrics.items() if isinstance(v, Tensor)}
    return StepOutcome(has, value, stop, metrics, torch.get_rng_state())


def apply_outcome(trainer: Any, outcome: StepOutcome) -> None:
    """Make this (non-last) stage's trainer see the last stage's metrics and stop decision, and its
    generator stand where the last stage's does."""
    torch.set_rng_state(outcome.rng)
    if trainer is None:
        return
    metrics = trainer.callback_metrics
    metrics.clear()
    metrics.update(outcome.metrics)
    if outcome.should_stop:
        trainer.should_stop = True


class OutcomeChannel:
    """Sends (last stage) or receives (other stages) one :class:`StepOutcome` per step over ``p2p``.

    Remembers the metric keys last sent to / received from each peer, so keys travel only when they
    change.

    Args:
        p2p: the stage's transport.
        device: where received metric values are put (the stage's device).
    """

    def __init__(self, p2p: P2P, device: torch.device) -> None:
        self.p2p = p2p
        self.device = device
        self._keys: dict[int, list[tuple[str, str, list[int]]]] = {}  # per peer: (name, dtype, shape)

    def send(self, outcome: StepOutcome, dst: int) -> None:
        """Post the outcome's message(s) to ``dst`` (waited for by the caller's next ``p2p.flush``)."""
        keys = [(k, str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in outcome.metrics.items()]
        follow = keys != self._keys.get(dst, [])
        values = [v.detach().to("cpu", torch.float64).reshape(-1) for v in outcome.metrics.values()]
        head = torch.tensor(
            [float(outcome.has_loss), outcome.loss, float(outcome.should_stop), float(follow), len(keys)],
            dtype=torch.float64,
        )
        self.p2p.send([torch.cat([head, *values]).to(self.device), outcome.rng.to(self.device)], dst)
        if follow:
            data = torch.frombuffer(bytearray(json.dumps(keys).encode()), dtype=torch.uint8)
            self.p2p.send([data.to(self.device)], dst)
            self._keys[dst] = keys

    def receive(self, src: int) -> StepOutcome:
        """Take one outcome from ``src`` (the last stage of this pipeline)."""
        _, (message, rng) = self.p2p.recv(src)
        message = message.cpu()
        has, loss, stop, follow, n = message[:_HEAD].tolist()
        if follow:
            _, (data,) = self.p2p.recv(src)
            self._keys[src] = [tuple(k) for k in json.loads(bytes(data.cpu().tolist()).decode())]  # type: ignore[misc]
        keys = self._keys.get(src, [])
        if len(keys) != int(n):
            raise RuntimeError(
                f"the step outcome from rank {src} has {int(n)} metrics but {len(keys)} known keys; "
                "the stages' messages are out of step"
            )
        metrics: dict[str, Tensor] = {}
        offset = _HEAD
        for name, dtype, shape in keys:
            numel = 1
            for d in shape:
                numel *= d
            value = message[offset : offset + numel].reshape(shape).to(getattr(torch, dtype))
            metrics[name] = value.to(self.device)
            offset += numel
        return StepOutcome(bool(has), loss, bool(stop), metrics, rng.cpu())
