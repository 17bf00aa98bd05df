"""Receives posted ahead as actions of a stage's column (torch's ``RECV_F`` and ``RECV_B``).

A :class:`Post` names one message a later action of the column takes: running it posts that
message's receive, so the message travels while the stage computes (on Gloo a message's bytes leave
the sender only once its receive is posted: :mod:`lightning_gpipe.transport.prefetch`).
:func:`with_posts` places the posts in a column, :data:`POSTED_AHEAD` messages per peer beyond the one
the stage takes next, and :func:`validate` checks a grid with its columns' posts: every message
posted once, in the order its peer sends it, before the action that takes it, and never more than
:data:`POSTED_AHEAD` + 1 posted and not taken.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from lightning_gpipe.schedule import grid as grids
from lightning_gpipe.schedule.grid import Action, Grid, format_grid
from lightning_gpipe.schedule.messages import SkipRoute, Transfer, receives

__all__ = ["POSTED_AHEAD", "Post", "Step", "with_posts", "validate"]

POSTED_AHEAD = 2
"""Messages per peer whose receives are posted beyond the one the stage takes next."""


@dataclass(frozen=True)
class Post:
    """Post the receive of the message ``action`` takes over ``transfer`` (printed ``R`` then the
    action and the peer, like ``RB2<1``), or of the step outcome (``action`` ``None``, printed ``RO<1``).

    The step outcome is the message the last stage sends each other stage after its last call of
    a step of one call per micro-batch (its loss, metrics, stop decision, generator state); the stage
    takes it after its column (:meth:`~lightning_gpipe.engine.stage.PipelineStage.share_outcome`).

    Attributes:
        action: the action of the same column that takes the message; ``None``: the step outcome.
        transfer: the message, as :func:`~lightning_gpipe.schedule.receives` names it for ``action``.
    """

    action: Action | None
    transfer: Transfer
    kind: ClassVar[str] = "R"

    def __str__(self) -> str:
        return f"R{self.action if self.action is not None else 'O'}<{self.transfer.peer}"


Step = Action | Post
"""One item of a column with its posts."""


def _taken(column: Sequence[Action], stage: int, stages: int, skips: list[SkipRoute], v: int) -> list[Post]:
    """The messages ``column`` takes, in the order it takes them, each as its :class:`Post`."""
    return [Post(a, t) for a in column for t in receives(a, stage, stages, skips, v)]


def with_posts(
    column: Sequence[Action],
    stage: int,
    stages: int,
    skips: Iterable[SkipRoute] = (),
    virtual_stages: int = 1,
    hold_backwards: bool = False,
    outcome: int | None = None,
) -> list[Step]:
    """``column`` (stage ``stage``'s actions, in order) with the receives of its messages posted
    ahead.

    Before each action, the messages from each peer that the actions before it take are posted,
    and :data:`POSTED_AHEAD` + 1 more: the first ones per peer at the column's start, then one more
    as each is taken; posts at one place come in the order the column takes their messages. With
    ``hold_backwards`` the messages of backwards are posted no earlier than the column's first
    backward
    (``schedule="gpipe"``: its backwards run only once the user's step has returned a loss, and a
    step without one takes none of them). With ``outcome`` (the last stage's index), the step
    outcome's receive is posted as that stage's message after its last one taken in the column, as
    far ahead as the others (once all but :data:`POSTED_AHEAD` of that stage's messages are taken; at
    the column's start where it takes none), so the outcome travels while the stage runs the rest
    of its column.
    """
    skips = list(skips)
    taken = [(a, t) for a in column for t in receives(a, stage, stages, skips, virtual_stages)]
    first_backward = next((k for k, a in enumerate(column) if a.kind != "F"), len(column))
    # per peer: (place in taken, the action taking it, its post)
    queues: dict[int, deque[tuple[int, Action | None, Post]]] = defaultdict(deque)
    for n, (a, t) in enumerate(taken):
        queues[t.peer].append((n, a, Post(a, t)))
    if outcome is not None:  # its stage's last message, taken after the column
        queues[outcome].append((len(taken), None, Post(None, Transfer(outcome))))
    done, posted, out = Counter[int](), Counter[int](), list[Step]()  # per peer: taken, posted so far
    for k in range(len(column) + 1):
        ready = []
        for peer, queue in queues.items():
            while queue and posted[peer] <= done[peer] + POSTED_AHEAD:
                action = queue[0][1]
                if hold_backwards and action is not None and action.kind != "F" and k < first_backward:
                    break
                ready.append(queue.popleft())
                posted[peer] += 1
        out += [p for _, _, p in sorted(ready, key=lambda x: x[0])]
        if k < len(column):
            done.update(t.peer for t in receives(column[k], stage, stages, skips, virtual_stages))
            out.append(column[k])
    return out


def validate(
    grid: Grid, columns: Mapping[int, Sequence[Step]] | None = None, skips: Iterable[SkipRoute] = ()
) -> None:
    """Check that a grid is a runnable pipeline schedule (:func:`~lightning_gpipe.schedule.grid.validate`)
    and that each stage's column with posts in ``columns`` runs its grid column's actions (or only
    its forwards) in order, each message posted exactly once, in the order the column takes them,
    before the action that takes it, with never more than :data:`POSTED_AHEAD` + 1 from one peer
    posted and not taken; a step outcome's post (at most one) as its stage's last message, after
    every other one from that stage is posted (it counts among the receives posted ahead).

    Raises:
        ValueError: naming the stage and the first violated rule, with the column printed.
    """
    grids.validate(grid)
    skips = list(skips)
    k, v = len(grid[0]) if grid else 0, grids.virtual_stages_of(grid)
    for stage, column in (columns or {}).items():
        shown = f"stage {stage}'s column {' '.join(map(str, column))}\n{format_grid(grid)}"
        actions = [a for a in column if isinstance(a, Action)]
        grid_column = grids.stage_actions(grid, stage)
        if actions not in (grid_column, [a for a in grid_column if a.kind == "F"]):
            raise ValueError(f"{shown}\nruns other actions than the grid's")
        expected = defaultdict[int, deque[Post]](deque)  # per peer, in the order the column takes them
        for p in _taken(actions, stage, k, skips, v):
            expected[p.transfer.peer].append(p)
        queue = defaultdict[int, deque[Post]](deque)
        outcome_posted = False
        for item in column:
            if isinstance(item, Post):
                if item.action is None:  # the step outcome: its stage's last message
                    if expected[item.transfer.peer] or outcome_posted:
                        raise ValueError(f"{shown}\nposts {item} twice or before that stage's other messages")
                    outcome_posted = True
                else:
                    mine = expected[item.transfer.peer]
                    if not mine or item != mine.popleft():
                        raise ValueError(f"{shown}\nposts {item} out of the order its messages are taken")
                queue[item.transfer.peer].append(item)
                if len(queue[item.transfer.peer]) > POSTED_AHEAD + 1:
                    raise ValueError(f"{shown}\nposts more than {POSTED_AHEAD + 1} receives ahead at {item}")
                continue
            for t in receives(item, stage, k, skips, v):
                waiting = queue[t.peer]
                if not waiting or waiting.popleft() != Post(item, t):
                    raise ValueError(
                        f"{shown}\n{item} takes a message from stage {t.peer} not posted before it"
                    )
