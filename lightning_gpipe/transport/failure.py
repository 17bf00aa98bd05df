"""A failure on one rank ends every rank promptly, with the original error shown first.

An error in a stage's layers is re-raised as a :class:`StageError` that names the stage, its
layers, the micro-batch and the input's shapes (:func:`naming_errors`).

Pipeline jobs hang when one rank dies while another waits in a receive. The rank that fails
prints its error, tagged with its stage, before anything else happens; then it tears down its
process group, which breaks the connections its peers wait on, so they fail within moments
(and so on down the pipeline) instead of waiting for the ``torch.distributed`` timeout. A peer
that fails only because a connection broke says so in its message, naming the rank that is gone
when one died or lost its connection (:mod:`lightning_gpipe.transport.liveness`).

The error's traceback is printed once: the report marks the exception it printed, and the
process' uncaught-exception hook (:func:`point_at_reports`) prints one line naming the rank
for that exception instead of its traceback again.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.errors import StageError
from lightning_gpipe.transport import liveness
from lightning_gpipe.transport.arrival import failure_note
from lightning_gpipe.transport.p2p import release_connections

log = logging.getLogger(__name__)

PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")

# the attribute report_and_abort sets on an exception whose traceback it printed: the rank's "where"
REPORTED = "gpipe_reported"

_hook: dict[str, Callable[..., Any]] = {}  # "previous": the uncaught-exception hook point_at_reports wraps


@contextmanager
def naming_errors(
    stage: int,
    layers: Sequence[str],
    first_layer: nn.Module | None,
    phase: str,
    i: int,
    x: Sequence[Tensor],
    keep: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Re-raise an error of stage ``stage``'s layers in ``phase`` (forward, backward) of micro-batch ``i``
    as a :class:`StageError` naming the stage, its layers, the input ``x``'s shapes and what
    ``first_layer`` expects; :class:`StageError` and the types in ``keep`` pass unchanged."""
    try:
        yield
    except Exception as err:
        if isinstance(err, (StageError, *keep)):
            raise
        source = "the batch" if stage == 0 else f"stage {stage - 1}"
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in x)
        raise StageError(
            f"stage {stage} (layers {layers[0]}..{layers[-1]}) failed in {phase} of micro-batch {i} on input "
            f"from {source} of shape [{shapes}]{_expected_input(first_layer)}: {type(err).__name__}: {err}"
        ) from err


def _expected_input(layer: Any) -> str:
    """What a stage's first layer expects, when the layer says (Linear, Conv, Embedding, norms)."""
    for attr, what in (
        ("in_features", "(*, {})"),
        ("in_channels", "(N, {}, ...)"),
        ("num_features", "(N, {}, ...)"),
    ):
        value = getattr(layer, attr, None)
        if isinstance(value, int):
            return f"; its first layer ({type(layer).__name__}) expects {what.format(value)}"
    return ""


def is_peer_loss(exception: BaseException) -> bool:
    """Whether ``exception`` is a transport error caused by another rank going away."""
    return isinstance(exception, RuntimeError) and any(p in str(exception) for p in PEER_LOSS)


def report_and_abort(exception: BaseException, where: str) -> None:
    """Print (a failure of this rank's own) or annotate (a peer's consequence) ``exception``, then abort
    this rank's group.

    A rank that fails for a reason of its own prints its error first, tells the other ranks that it
    leaves on purpose (:func:`~lightning_gpipe.transport.liveness.leave`), then tears its group down.
    A rank that stops because a connection broke tears its group down first (its own peers learn at
    once), then names the rank that failed with an error of its own and that error, where one left
    saying so (:func:`~lightning_gpipe.transport.liveness.departed`), or else finds out which rank is
    gone (:func:`~lightning_gpipe.transport.liveness.lost`, a few seconds: a rank killed with SIGKILL
    prints nothing) and names it.

    Args:
        exception: what this rank raised.
        where: e.g. ``"stage 1 (rank 1)"``.
    """
    if not is_peer_loss(exception):
        # the tag first, then the traceback: the other ranks may end this process before it exits;
        # a SystemExit (sys.exit(3) in a callback) has none to show, as Python prints none
        trace = "" if isinstance(exception, SystemExit) else "\n" + _whole_traceback(exception)
        print(
            f"[lightning_gpipe] {where} failed: {type(exception).__name__}: {exception}{trace}",
            file=sys.stderr,
            flush=True,
        )
        _mark_reported(exception, where)
        liveness.leave(f"{where} failed: {_said(exception)}")
        abort_process_group()
        return
    note, others = failure_note(), _other_ranks()
    abort_process_group()
    failed = [why for _, why in sorted(liveness.departed(others).items()) if " failed: " in why]
    # this rank beats on meanwhile: not counted gone
    cause = None if failed or not others else liveness.lost(others)
    liveness.leave(f"{where} stopped after a connection broke")
    if cause:
        reason = cause
    elif note:
        reason = f"another rank of the job failed ({note})"
    elif failed:
        reason = (
            f"another rank of the job failed ({'; '.join(failed)}; its report is printed, tagged "
            "[lightning_gpipe], in that rank's output)"
        )
    else:
        reason = (
            "another rank of the job failed; its error is printed, tagged [lightning_gpipe], "
            "in that rank's output"
        )
    peer = _waited_on(exception)
    if peer is not None:
        reason += f"; this rank was waiting for a message from {liveness.describe(peer)}"
    _prefix_message(exception, f"[lightning_gpipe] {where} stopped because {reason}. Connection error: ")


def _whole_traceback(exception: BaseException) -> str:
    """``exception``'s traceback as the interpreter prints it uncaught: its own frames preceded by the
    frames that called the first of them, while that one still runs (the caller of ``trainer.fit``:
    the pointer :func:`excepthook` prints in its place repeats none of them)."""
    lines = traceback.format_exception(exception)
    tb = exception.__traceback__
    frame: FrameType | None = sys._getframe(1)
    while tb is not None and frame is not None and frame is not tb.tb_frame:
        frame = frame.f_back
    if tb is None or frame is None or frame.f_back is None:
        return "".join(lines)  # the frame that caught it has returned: its callers are not known
    outer = traceback.StackSummary.extract(traceback.walk_stack(frame.f_back))
    outer.reverse()
    own = max(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)"))
    return "".join(lines[: own + 1] + outer.format() + lines[own + 1 :])


def _mark_reported(exception: BaseException, where: str) -> None:
    """Mark ``exception`` as printed by the report of ``where`` (:func:`excepthook`)."""
    with suppress(AttributeError, TypeError):  # an exception type that takes no attributes: printed again
        setattr(exception, REPORTED, where)


def point_at_reports() -> None:
    """Make :func:`excepthook` this process' uncaught-exception hook, wrapping the one in place (once per
    process). Call it before ``init_process_group``, which wraps the hook in place in its ``[rank R]``
    prefix."""
    if "previous" not in _hook:
        _hook["previous"] = sys.excepthook
        sys.excepthook = excepthook


def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """Hand an uncaught exception to the hook it wraps (:func:`point_at_reports`), except one whose
    traceback :func:`report_and_abort` printed already: for that one, one line naming the rank and the
    error's type, pointing at the report above, in place of the interpreter's own print; a hook the user
    installed gets it too (a crash logger records the error that ended the process).

    Args:
        kind, value, tb: as for :func:`sys.excepthook`.
    """
    previous = _hook.get("previous", sys.__excepthook__)
    where = getattr(value, REPORTED, None)
    if not isinstance(where, str):
        previous(kind, value, tb)
        return
    print(
        f"[lightning_gpipe] {where} exits on the {kind.__name__} reported above (its traceback "
        f'follows "[lightning_gpipe] {where} failed")',
        file=sys.stderr,
        flush=True,
    )
    if previous is not sys.__excepthook__:
        previous(kind, value, tb)


def _said(exception: BaseException, limit: int = 600) -> str:
    """``"ValueError: its message"``, cut at ``limit`` characters: what the other ranks name."""
    said = f"{type(exception).__name__}: {exception}"
    return said if len(said) <= limit else said[: limit - 3] + "..."


def _waited_on(exception: BaseException) -> int | None:
    """The rank whose message ``exception`` (or an exception it came from) broke off
    (:func:`lightning_gpipe.transport.p2p.waited_on`)."""
    seen: BaseException | None = exception
    for _ in range(8):
        if seen is None:
            return None
        peer = getattr(seen, "gpipe_peer", None)
        if isinstance(peer, int):
            return peer
        seen = seen.__cause__ or seen.__context__
    return None


def _other_ranks() -> list[int]:
    """Every rank of the job but this one (none outside ``torch.distributed``)."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    me = dist.get_rank()
    return [r for r in range(dist.get_world_size()) if r != me]


def _prefix_message(exception: BaseException, prefix: str) -> None:
    if exception.args and isinstance(exception.args[0], str):
        exception.args = (prefix + exception.args[0], *exception.args[1:])


def abort_process_group() -> None:
    """Tear down this rank's communication so that peers blocked on it fail now, not at the timeout."""
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - best effort while already failing
        log.debug(f"gpipe: could not destroy the process group after a failure: {err}")
    release_connections()  # the lanes and posted receives: their sockets close once nothing holds them
