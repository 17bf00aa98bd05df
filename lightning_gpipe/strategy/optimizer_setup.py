"""``configure_optimizers`` under the strategy: one optimizer, its outcome agreed by every rank.

Each stage runs ``configure_optimizers`` over its own layers
(:meth:`~lightning_gpipe.strategy.pipelined.Pipelined.configuring`), so one device's code that returns
several optimizers fails differently on each rank: Lightning's multiple-optimizer error where each
optimizer got parameters, torch's ``optimizer got an empty parameter list`` on a stage that holds
none of an optimizer's layers. :func:`setup_single_optimizer` runs Lightning's setup, counts the
optimizers ``configure_optimizers`` returned, and every rank compares its outcome with the others'
(one object all-gather, after :func:`~lightning_gpipe.transport.arrival.arrive`): where any rank
counted several, every rank raises the same ``ValueError`` naming the count and the fix; where a rank
failed otherwise, it raises its own error, and the others a :class:`~lightning_gpipe.errors.RankFailed`
naming it, at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from lightning_gpipe.errors import RankFailed
from lightning_gpipe.transport import groups

__all__ = ["count_optimizers", "setup_single_optimizer"]

FIX = (
    "the gpipe strategy runs one forward and one backward per step and supports a single optimizer: "
    "return one optimizer over self.parameters(), with parameter groups for per-layer settings, e.g. "
    'torch.optim.SGD([{"params": self.layers[:2].parameters(), "lr": 0.1}, '
    '{"params": self.layers[2:].parameters()}], lr=0.01) (a group may be empty on a stage)'
)


def count_optimizers(conf: Any) -> int:
    """How many optimizers ``configure_optimizers``'s return value ``conf`` holds, in any of Lightning's
    forms (an optimizer, a dict, a list of optimizers or dicts, ``([optimizers], [schedulers])``)."""
    if conf is None:
        return 0
    if isinstance(conf, (Optimizer, dict)):
        return 1
    if isinstance(conf, (list, tuple)):
        if len(conf) == 2 and all(isinstance(part, (list, tuple)) for part in conf):
            return count_optimizers(conf[0])
        return sum(count_optimizers(item) for item in conf if isinstance(item, (Optimizer, dict)))
    return 1


def setup_single_optimizer(
    strategy: Any, setup: Callable[[], None], configuring: AbstractContextManager[Any]
) -> None:
    """Run ``setup`` (Lightning's ``setup_optimizers``) inside ``configuring``, then agree over every rank.

    Args:
        strategy: the GPipeStrategy (its LightningModule's ``configure_optimizers``'s return value is
            counted; its ``collective_timeout`` bounds the wait for the other ranks).

    Raises:
        ValueError: a rank's ``configure_optimizers`` returned several optimizers (every rank), or this
            rank's optimizer got no parameter of its stage (the message says what the stage sees).
        RankFailed: another rank failed in ``configure_optimizers`` or Lightning's setup.
        Exception: this rank's own error in ``setup``.
    """
    module, timeout = strategy.lightning_module, strategy.collective_timeout
    where = f"stage {strategy.stage_index} (rank {strategy.global_rank})"
    counted: list[int] = []
    previous = vars(module).get("configure_optimizers")
    user_hook = module.configure_optimizers

    def counting() -> Any:
        conf = user_hook()
        counted.append(count_optimizers(conf))
        return conf

    error: Exception | None = None
    vars(module)["configure_optimizers"] = counting
    try:
        with configuring:
            setup()
        counted.append(len(strategy.optimizers))
        # a sharded stage (lightning_gpipe.strategy.sharding) makes their shards whole with its own (teardown)
        sharded = getattr(getattr(strategy, "_pipelined", None), "sharded", None)
        if sharded is not None:
            sharded.optimizers = list(strategy.optimizers)
    except Exception as err:  # noqa: BLE001 - agreed with the other ranks below
        error = _explained(err, where)
    finally:
        if previous is None:
            vars(module).pop("configure_optimizers", None)
        else:
            vars(module)["configure_optimizers"] = previous
    mine = (max(counted, default=0), where, None if error is None else f"{type(error).__name__}: {error}")
    outcomes = _gathered(mine, timeout)
    most, at, _ = max(outcomes, key=lambda outcome: outcome[0])
    if most > 1:
        raise ValueError(f"configure_optimizers returned {most} optimizers (on {at}); {FIX}") from error
    if error is not None:
        raise error
    failed = [f"{at} failed: {said}" for _, at, said in outcomes if said is not None]
    if failed:
        raise RankFailed(f"configure_optimizers needs every rank, but {'; '.join(failed)}")


def _explained(err: Exception, where: str) -> Exception:
    """torch's empty-parameter error said with what a stage's ``configure_optimizers`` sees."""
    if isinstance(err, ValueError) and "empty parameter list" in str(err):
        explained = ValueError(
            f"configure_optimizers on {where} created an optimizer without parameters: it sees only this "
            "stage's layers (self.parameters(), self.layers[k] of another stage's layer is empty), so an "
            f"optimizer over other stages' layers gets none here; {FIX}"
        )
        explained.__cause__ = err
        return explained
    return err


def _gathered(mine: tuple[int, str, str | None], timeout: float) -> list[tuple[int, str, str | None]]:
    """Every rank's ``mine`` (this process's alone outside ``torch.distributed``)."""
    if not groups.initialized() or dist.get_world_size() < 2:
        return [mine]
    groups.arrive_all("configure_optimizers", timeout)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    return [tuple(outcome) for outcome in outcomes]
