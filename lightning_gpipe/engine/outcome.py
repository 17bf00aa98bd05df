"""One truth per step: what the last stage decided in a step reaches every stage before any hook runs.

Only the last stage of a pipeline runs the user's code after the pipelined call: the loss,
``self.log``, the step's outputs, and any trainer state set there (``self.trainer.should_stop =
True``). Lightning's callbacks, LR schedulers (``ReduceLROnPlateau`` with ``interval="step"`` reads
``trainer.callback_metrics``) and the user's hooks run on every rank, right after the step. So
after every training, validation and test step, the last stage sends each other stage of its
pipeline a :class:`StepOutcome`: whether the step has a loss (and its value), ``should_stop``,
``trainer.callback_metrics`` as they stand after the step, the factor the step's gradients take
(:mod:`lightning_gpipe.strategy.step_outputs`), what the step returned besides its loss (the
``outputs`` Lightning hands ``on_*_batch_end``), and the state of ``torch``'s CPU generator. Each
stage installs it before Lightning goes on (:func:`apply_outcome`), so ``on_train_batch_end``,
schedulers and callbacks read the current step's values everywhere, and every stage's generator
stands where the last stage's does: what the user's code draws after the pipelined call (a sampled
loss, random targets) is drawn on the last stage only, and a shuffling loader draws its next epoch's
order from that generator on every stage (the stages' layers draw from their own streams:
:mod:`lightning_gpipe.engine.rng`).

Wire format: it rides on the message the stages already exchange after a training forward (the
loss message), one message per other stage and step: a float64 vector
``[has_loss, loss, should_stop, keys_follow, n, gradient_scale, v_1 … v_n]`` (``8·(n + 6)``
bytes), the metric values flattened in key order, and the generator's state (5 056 bytes), plus
the transport's 512-byte header. The keys (names, dtypes, shapes) travel as a second, uint8
message only when they change (the first step, a new logged key), so a steady step costs no extra
message. Step outputs (a training step's dict less its loss; an evaluation step's return value)
travel in the same message, their tensors after the generator's state and their structure as the
transport's restricted codec (:func:`lightning_gpipe.transport.wire.encode_structure`, never
pickle); a value that cannot travel (an object other than a tensor, ``None``, ``bool``, ``int``,
``float`` or ``str`` in dicts, lists and tuples, or a tensor past what the message's 64-slot header
describes: some ten tensors) reaches the other stages as ``None``, with a warning once. Validation
and test steps have no loss message of their own; they send the same one (``has_loss = 0``).
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.engine.microbatch import flatten, unflatten
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.structure import CONSTANTS, TREE
from lightning_gpipe.transport.wire import HEADER_SLOTS, can_travel, header_slots

_HEAD = 6  # has_loss, loss, should_stop, keys_follow, n, gradient_scale
_WARNED: set[str] = set()


@dataclass
class StepOutcome:
    """What the last stage decided in one step.

    Attributes:
        has_loss: the step returned a loss (training steps; otherwise no stage runs a backward).
        loss: its value (a scalar loss; 0.0 otherwise).
        should_stop: ``trainer.should_stop`` after the step.
        metrics: ``trainer.callback_metrics`` after the step.
        rng: ``torch``'s CPU generator state after the step (``torch.get_rng_state()``).
        gradient_scale: the factor the step's gradients take before they join the parameters'
            (:func:`lightning_gpipe.strategy.step_outputs.gradient_scale`; 1.0 but for token-count
            losses under one ``training_step`` per micro-batch).
        outputs: what the step returned besides its loss: a training step's dict less ``"loss"``
            (``None``: a tensor loss), an evaluation step's return value.
    """

    has_loss: bool = False
    loss: float = 0.0
    should_stop: bool = False
    metrics: dict[str, Tensor] = field(default_factory=dict)
    rng: Tensor = field(default_factory=torch.get_rng_state)
    gradient_scale: float = 1.0
    outputs: Any = None


def outcome_of(trainer: Any, out: Any, training: bool = True, gradient_scale: float = 1.0) -> StepOutcome:
    """The last stage's outcome of the step that returned ``out``: a training step's (a loss, a dict with
    ``"loss"``, or None) or an evaluation step's (anything)."""
    loss = out.get("loss") if training and isinstance(out, Mapping) else out if training else None
    has = isinstance(loss, Tensor)
    value = float(loss.detach().float()) if isinstance(loss, Tensor) and loss.numel() == 1 else 0.0
    metrics = dict(trainer.callback_metrics) if trainer is not None else {}
    stop = bool(trainer.should_stop) if trainer is not None else False
    metrics = {k: v for k, v in metrics.items() if isinstance(v, Tensor)}
    if training:
        extras = {k: v for k, v in out.items() if k != "loss"} if isinstance(out, Mapping) else None
        outputs = extras or None  # a dict of the loss alone: nothing to send
    else:
        outputs = out
    return StepOutcome(has, value, stop, metrics, torch.get_rng_state(), gradient_scale, outputs)


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


_OUTPUT_SLOTS = HEADER_SLOTS - 3 - 2 * 4 - 4  # less the message's own fields, the vector, the rng, the blob


def portable(value: Any, path: str = "", slots: list[int] | None = None) -> tuple[Any, list[str]]:
    """``value`` as it can travel between stages, and the paths of what cannot (replaced by ``None``):
    tensors (detached) of a dtype the transport knows, ``None``, ``bool``, ``int``, ``float`` and ``str``,
    in dicts (keys of those constants), lists and tuples; and no more tensors than the message's header
    can describe (``slots``: the header slots left, :data:`_OUTPUT_SLOTS` at first)."""
    slots = [_OUTPUT_SLOTS] if slots is None else slots
    if isinstance(value, Tensor):
        if not can_travel(value) or header_slots(value) > slots[0]:
            return None, [path or "the value"]
        slots[0] -= header_slots(value)
        return value.detach(), []
    if type(value) in CONSTANTS:
        return value, []
    if type(value) in (list, tuple):
        parts = [portable(v, f"{path}[{k}]", slots) for k, v in enumerate(value)]
        return type(value)(v for v, _ in parts), [p for _, bad in parts for p in bad]
    if type(value) in (dict, OrderedDict) and all(type(k) in CONSTANTS for k in value):
        items = {k: portable(v, f"{path}[{k!r}]", slots) for k, v in value.items()}
        kept = type(value)((k, v) for k, (v, _) in items.items())
        return kept, [p for _, bad in items.values() for p in bad]
    return None, [path or "the value"]


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
        head = [float(outcome.has_loss), outcome.loss, float(outcome.should_stop), float(follow), len(keys)]
        head.append(outcome.gradient_scale)
        vector = torch.cat([torch.tensor(head, dtype=torch.float64), *values]).to(self.device)
        if outcome.outputs is None:
            self.p2p.send([vector, outcome.rng.to(self.device)], dst)
        else:
            outputs, lost = portable(outcome.outputs)
            _warn_lost(lost)
            tensors, structure = flatten((vector, outcome.rng.to(self.device), [outputs]), "step outputs")
            self.p2p.send([t.to(self.device) for t in tensors], dst, structure=structure)
        if follow:
            data = torch.frombuffer(bytearray(json.dumps(keys).encode()), dtype=torch.uint8)
            self.p2p.send([data.to(self.device)], dst)
            self._keys[dst] = keys

    def receive(self, src: int) -> StepOutcome:
        """Take one outcome from ``src`` (the last stage of this pipeline)."""
        meta, tensors = self.p2p.recv(src)
        outputs = None
        if meta.structure.kind == TREE:
            message, rng, (outputs,) = unflatten(meta.structure, tensors)
        else:
            message, rng = tensors
        message = message.cpu()
        has, loss, stop, follow, n, scale = message[:_HEAD].tolist()
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
        return StepOutcome(bool(has), loss, bool(stop), metrics, rng.cpu(), scale, outputs)


def _warn_lost(paths: list[str]) -> None:
    """Warn once per path that a step output cannot reach the other stages."""
    new = [p for p in paths if p not in _WARNED]
    if new:
        _WARNED.update(new)
        warnings.warn(
            f"the step output at {', '.join(new)} cannot travel to the pipeline's other stages, whose "
            "on_*_batch_end hooks get None in its place: return tensors, None, bool, int, float or str, in "
            "dicts, lists and tuples (e.g. float(x), a tensor instead of an array), and at most some ten "
            "tensors",
            stacklevel=3,
        )
