"""A failure on one rank ends every rank promptly, with the original error shown first.

Pipeline jobs hang when one rank dies while another waits in a receive. The rank that fails
prints its error, tagged with its stage, before anything else happens; then it tears down its
process group, which breaks the connections its peers wait on, so they fail within moments
(and so on down the pipeline) instead of waiting for the ``torch.distributed`` timeout. A peer
that fails only because a connection broke says so in its message.
"""

from __future__ import annotations

import logging
import sys
import traceback

import torch.distributed as dist

log = logging.getLogger(__name__)

PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def is_peer_loss(exception: BaseException) -> bool:
    """Whether ``exception`` is a transport error caused by another rank going away."""
    return isinstance(exception, RuntimeError) and any(p in str(exception) for p in PEER_LOSS)


def report_and_abort(exception: BaseException, where: str) -> None:
    """Print (first failure) or annotate (a peer's consequence) ``exception``, then abort this rank's group.

    Args:
        exception: what this rank raised.
        where: e.g. ``"stage 1 (rank 1)"``.
    """
    if is_peer_loss(exception):
        from lightning_gpipe.arrival import failure_note

        note = failure_note()
        _prefix_message(
            exception,
            f"[lightning_gpipe] {where} stopped because another rank of the job failed"
            + (f" ({note})" if note else "")
            + "; that rank's error is printed above, tagged [lightning_gpipe]. Connection error: ",
        )
    else:
        # the tag first, then the traceback: the other ranks may end this process before it exits
        trace = "".join(traceback.format_exception(exception))
        print(
            f"[lightning_gpipe] {where} failed: {type(exception).__name__}: {exception}\n{trace}",
            file=sys.stderr,
            flush=True,
        )
    abort_process_group()


def _prefix_message(exception: BaseException, prefix: str) -> None:
    if exception.args and isinstance(exception.args[0], str):
        exception.args = (prefix + exception.args[0], *exception.args[1:])


def abort_process_group() -> None:
    """Tear down this rank's communication so that peers blocked on it fail now, not at the timeout."""
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - best effort while already failing
        log.debug(f"gpipe: could not destroy the process group after a failure: {err}")
