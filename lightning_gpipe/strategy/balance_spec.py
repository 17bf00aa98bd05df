"""The ``balance=`` argument of the strategy: validate it, and resolve a balancer's name to layers per stage.

``balance`` is a list of layers per stage, ``None`` (as even as possible by layer count), or the
name of a balancer (:data:`BALANCERS`): ``"uniform"`` (layer count), ``"parameters"``
(parameter count per layer, computed on every rank), ``"time"`` (profiled forward + backward
seconds per layer) or ``"memory"`` (profiled activation + parameter bytes per layer, parameters
counted ``1 + optimizer_state_factor`` times). Profiling runs once, on global rank 0, on the
stages' device, with one micro-batch of the first training batch (or ``example_input_array``);
every rank receives the result, so every rank cuts the same stages.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gpipe._lightning import attached_trainer, running_loop_data
from lightning_gpipe.balance import balance_by_memory, balance_by_parameters, balance_by_time
from lightning_gpipe.engine.microbatch import as_tensors, split
from lightning_gpipe.partition.plan_chain import PlanChain
from lightning_gpipe.partition.plan_forward import chain_input
from lightning_gpipe.strategy.batch_norm import batch_norms
from lightning_gpipe.strategy.metrics import restore_logging, silence_logging

__all__ = ["BALANCERS", "check_balance_spec", "choose_balance", "log_choice", "sample_micro_batch"]

BALANCERS = ("uniform", "parameters", "time", "memory")


def check_balance_spec(
    balance: Any, pipeline_parallel_size: int | None, virtual_stages: int = 1
) -> list[int] | str | None:
    """Validate ``GPipeStrategy(balance=...)`` before anything runs; return it (a list copied).

    With ``virtual_stages`` v > 1 a list gives the layers of each of the ``K·v`` parts in model
    order (stage ``j`` holds parts ``j, j+K, …``), and a balancer balances over ``K·v`` parts.

    Raises:
        ValueError: an unknown balancer name, an entry that is not a positive integer, or a list
            whose length differs from ``pipeline_parallel_size × virtual_stages``.
    """
    if isinstance(balance, str):
        if balance not in BALANCERS:
            raise ValueError(
                f"balance must be a list of layers per stage, None, or one of "
                f"{', '.join(repr(b) for b in BALANCERS)} (balance: {balance!r})"
            )
        return balance
    if balance is None:
        return None
    if isinstance(balance, bytes) or not hasattr(balance, "__iter__"):
        raise ValueError(f"balance must be a list of layers per stage or None (balance: {balance!r})")
    bad = [b for b in balance if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad or not list(balance):
        raise ValueError(
            f"balance entries must be positive integers (balance: {list(balance)!r}); "
            "every stage needs a layer"
        )
    balance = list(balance)
    valid_size = (
        isinstance(pipeline_parallel_size, int) and pipeline_parallel_size >= 1
    )  # else checked by the caller
    parts = pipeline_parallel_size * virtual_stages if isinstance(pipeline_parallel_size, int) else 0
    if valid_size and virtual_stages > 1 and len(balance) != parts:
        raise ValueError(
            f"balance has {len(balance)} entries but the pipeline has {pipeline_parallel_size} stages × "
            f"{virtual_stages} virtual stages (balance: {balance}); "
            f"give one entry per part, {parts} in model order"
        )
    if valid_size and virtual_stages == 1 and len(balance) != pipeline_parallel_size:
        raise ValueError(
            f"balance has {len(balance)} stages but pipeline_parallel_size is {pipeline_parallel_size} "
            f"(balance: {balance}); give one entry per stage"
        )
    return balance


def choose_balance(
    how: list[int] | str | None,
    model: pl.LightningModule,
    seq: nn.Sequential,
    uniform: list[int],
    *,
    stages: int,
    chunks: int,
    device: torch.device,
    rank: int,
    broadcast: Callable[[Any], Any],
    to_device: Callable[[Any], Any],
    optimizer_state_factor: float,
) -> list[int]:
    """Resolve ``balance="parameters" | "time" | "memory"``: rank 0 decides, every rank receives.

    Args:
        how: the ``balance`` argument; a list or ``None``/``"uniform"`` returns ``uniform``.
        uniform: the layer-count balance (already checked against ``seq``).
        broadcast: ``broadcast(obj)`` from global rank 0 to every rank (all ranks call it).
        to_device: moves a batch to ``device`` (the strategy's ``batch_to_device``).

    Raises:
        RuntimeError: on ranks other than 0, when profiling failed on rank 0 (which raises the
            original error itself).
    """
    if not isinstance(how, str) or how == "uniform":
        return uniform
    if how == "parameters":
        return balance_by_parameters(seq, stages)
    key = (how, stages, chunks)
    known = _CHOSEN.get(model, {}).get(key)
    _PROFILED[model] = known is None
    if known is not None:  # profiled once per model: fit, then validate/test/predict reuse the balance
        return list(known)
    chosen: list[int] | None = None
    error: str | None = None
    if rank == 0:
        try:
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):  # profiling leaves the RNG streams as they were
                sample = sample_micro_batch(model, seq, how, chunks, device, to_device)
                if how == "time":
                    chosen = balance_by_time(seq, sample, stages, device=device)
                else:
                    chosen = balance_by_memory(
                        seq, sample, stages, optimizer_factor=optimizer_state_factor, device=device
                    )
        except Exception as err:  # every rank must hear of it, or the others would wait forever
            error = f"{type(err).__name__}: {err}"
            raise
        finally:
            broadcast((chosen, error))
    else:
        chosen, error = broadcast((None, None))
        if error is not None:
            raise RuntimeError(f"balance={how!r}: profiling on rank 0 failed: {error}")
    assert chosen is not None
    _CHOSEN.setdefault(model, {})[key] = list(chosen)
    return chosen


def profiled(model: nn.Module) -> bool:
    """Whether the last :func:`choose_balance` for ``model`` profiled (``False``: it reused a choice)."""
    return _PROFILED.get(model, False)


def log_choice(model: pl.LightningModule, how: str, balance: list[int]) -> None:
    """Say which balance ``balance=how`` chose, and log it as the hyperparameter ``gpipe_balance``
    (rank 0)."""
    rank_zero_info(f"gpipe: balance={how!r} chose {balance} (layers per stage)")
    trainer = attached_trainer(model)
    for logger in trainer.loggers if trainer is not None else ():
        logger.log_hyperparams({"gpipe_balance": balance})


# balance="time"/"memory" chosen per model and (how, stages, chunks): profiled once, reused by later loops
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int, int], list[int]]] = (
    weakref.WeakKeyDictionary()
)
_PROFILED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


class _Captured(BaseException):  # noqa: N818 - control flow, not an error
    """Stops the user's training_step once the sample input is captured."""


def sample_micro_batch(
    model: pl.LightningModule,
    seq: nn.Sequential,
    how: str,
    chunks: int,
    device: torch.device,
    to_device: Callable[[Any], Any],
) -> Any:
    """One micro-batch of what the pipelined Sequential receives: from ``example_input_array``,
    else captured by running the user's step on the first batch of the running loop (``fit``:
    ``training_step`` on the training data; ``validate``/``test``/``predict``: that loop's step
    on its data) up to the Sequential's call. A plan's chain (:class:`~lightning_gpipe.partition.
    plan_chain.PlanChain`) is never called itself: its input is captured at the call of the module whose
    forward is the chain (the plan's root), as the stage would take it. When the Sequential holds a
    BatchNorm the micro-batch keeps 2 samples or more (the layers are profiled in training mode, where
    ``BatchNorm1d`` raises on one sample, even for a BatchNorm the user froze; issue 40).

    Raises:
        ValueError: ``training_step`` did not call the Sequential (or the plan's root) and there is no
            ``example_input_array``.
    """
    sample = model.example_input_array
    if sample is None:
        step, loader = running_loop_data(model.trainer)
        batch = to_device(next(iter(loader)))
        captured: list[Any] = []

        def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured.append(chain_input(seq, args, kwargs) if isinstance(seq, PlanChain) else args[0])
            raise _Captured

        called = seq.root if isinstance(seq, PlanChain) else seq
        handle = called.register_forward_pre_hook(capture, with_kwargs=True)
        silence_logging(model)  # outside the loop, Lightning refuses self.log
        try:
            with torch.no_grad(), contextlib.suppress(_Captured):
                getattr(model, step)(batch, 0)
        finally:
            handle.remove()
            restore_logging(model)
        if not captured:
            what = "the pipelined Sequential"
            if isinstance(seq, PlanChain):
                root = f"self.{seq.root_name}" if seq.root_name else "self"
                what = f"{root}(...), whose forward is the plan's chain,"
            raise ValueError(
                f"balance={how!r} needs a sample input: {step} did not call {what} on the first batch; "
                "set LightningModule.example_input_array"
            )
        sample = captured[0]
    tensors, is_tuple = as_tensors(sample, "the sample input for balancing")
    if batch_norms(seq):  # profiled in training mode, where a BatchNorm1d refuses a single sample
        chunks = min(chunks, max(1, len(tensors[0]) // 2))
    first = split([t.to(device) for t in tensors], chunks)[0]
    return first if is_tuple else first[0]
