"""One ``training_step`` call per micro-batch: the contract of every schedule but ``"gpipe"``.

1F1B (:func:`lightning_gpipe.schedule.one_f_one_b`) runs the backward of micro-batch ``i`` before
the forward of micro-batch ``i + K``, so the loss of micro-batch ``i`` must exist before the
user's code has seen the later micro-batches. Under ``GPipeStrategy(schedule="1f1b")`` the
strategy therefore runs the user's ``training_step`` once per micro-batch, as
``accumulate_grad_batches`` would run it once per batch:

- the batch is split like the pipeline's input: every tensor of the batch (any nesting of
  tuples, lists, dicts, dataclasses) with the batch's dim 0 ``N`` into ``min(M, N)`` parts of
  :func:`lightning_gpipe.engine.microbatch.sizes` ``(N, M)``; other tensors (0-d, another dim 0, marked
  with ``no_chunk``) and other values reach every call whole;
- the loss call ``i`` returns (a tensor, or a dict's ``"loss"``) is weighted by its share of the
  batch, ``n_i / N`` (with ``"num_items"`` returned, by its share of the batch's items:
  :mod:`lightning_gpipe.strategy.step_outputs`), divided by ``accumulate_grad_batches`` as
  Lightning divides a loss, scaled by the precision plugin's ``GradScaler`` if it has one, and
  backpropagated by the strategy right after the call (on the last stage, into the call's output;
  the stage's backward carries it on): for a loss that is a mean over samples (or over its
  ``num_items``) the accumulated gradient equals the full batch's;
- the gradients made during the calls are set aside and added to the parameters' gradients in
  Lightning's ``backward`` (which comes after Lightning's ``zero_grad``), so hooks, clipping,
  the optimizer step and gradient accumulation see them where they see a one-device backward's;
  the last stage's weight passes after its last message (``schedule="zb_h1"``'s last ``W``) run
  there too, into the set-aside gradients, so that the step outcome leaves without waiting for them;
- ``training_step`` returns ``sum_i w_i · loss_i`` (``w_i``: the weights above, summing to 1), the
  full batch's loss for a mean loss, as a tensor with no graph, so that Lightning's own
  ``backward`` adds nothing; a dict output's other entries are the calls' combined
  (:func:`lightning_gpipe.strategy.step_outputs.combine`: tensors concatenated along dim 0, floats
  averaged with the weights ``w_i``, integers summed), so ``on_train_batch_end(outputs, ...)`` gets
  what one call on the whole batch returns;
- ``self.log`` (and ``log_dict``) inside the calls is recorded, and after the last call each name
  is logged once with the same options and the values combined over the calls: a mean weighted
  by ``w_i`` (``reduce_fx="mean"``, the default), the sum (``"sum"``), the maximum (``"max"``) or
  the minimum (``"min"``); a torchmetrics ``Metric``, or a value its ``forward`` returned, is logged
  with its value over the whole batch (:mod:`lightning_gpipe.strategy.step_metrics`; its state has
  seen every micro-batch);
  ``batch_size=``, when given, is summed over the calls; a NaN from a one-sample micro-batch (a
  ``std`` of one sample) is left out, with a warning once. The progress bar, the loggers and
  ``trainer.callback_metrics`` see the full batch's value.

Losses that qualify: means over samples whose every sample counts the same (``F.mse_loss``,
``F.cross_entropy`` with ``reduction="mean"`` over equally many targets per sample), and means
over a count that differs between micro-batches (``ignore_index`` targets) returned with that
count as ``{"loss": loss, "num_items": k}``. Losses that do not: batch-wide ones (contrastive
losses over the batch's pairs) and means over such a count returned without it: use
``schedule="gpipe"``, which runs ``training_step`` once on the whole batch.

Refused before any process starts (:func:`check_model`): manual optimization. Refused during the
step: a batch without a tensor with a batch dimension, a call that returns no loss on the last stage, a
call that does not call the pipelined Sequential while others do.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_gpipe import _lightning
from lightning_gpipe.engine.microbatch import batch_dim, is_split, sizes
from lightning_gpipe.engine.stage import PipelineStage, PipelineUsageError, StageDone
from lightning_gpipe.strategy import step_metrics
from lightning_gpipe.strategy.loss_graph import check_loss_graph
from lightning_gpipe.strategy.step_outputs import (
    combine_outputs,
    gradient_scale,
    ignores_targets,
    loss_weights,
    num_items_of,
    without_loss,
)

__all__ = ["MicroSteps", "check_model", "split_batch", "warn_unsplit_backwards"]

_MISSING = object()
_FORWARD = object()  # marks a logged value that a metric's forward returned


def check_model(model: Any, schedule: str) -> None:
    """Raise before any process starts if ``model`` cannot run one ``training_step`` per micro-batch.

    Raises:
        ValueError: the module uses manual optimization (the strategy backpropagates each
            micro-batch's loss itself).
    """
    if schedule != "gpipe" and not model.automatic_optimization:
        raise ValueError(
            f"{type(model).__name__} uses manual optimization (automatic_optimization = False), which "
            f"schedule={schedule!r} does not support: the strategy runs training_step once per micro-batch "
            "and backpropagates each loss itself; use schedule='gpipe' or automatic optimization"
        )


def warn_unsplit_backwards(schedule: str, checkpoint: str) -> None:
    """Warn (rank 0) that ``schedule="zb_h1"`` splits no backward of a recomputed micro-batch, unless
    ``checkpoint="never"``."""
    if schedule == "zb_h1" and checkpoint != "never":
        rank_zero_warn(
            f"schedule='zb_h1' splits only the backwards of micro-batches whose forward is not "
            f"recomputed; under checkpoint={checkpoint!r} the others run whole at their B, as "
            "under 1F1B. Use checkpoint='never' for the zero-bubble gain."
        )


def split_batch(batch: Any, chunks: int, min_size: int = 1) -> tuple[list[Any], list[int]]:
    """``batch`` as ``min(chunks, N)`` micro-batches (at most ``N // min_size``, at least one), and their
    sizes (:func:`~lightning_gpipe.engine.microbatch.sizes`).

    The pipeline's split rule (:func:`lightning_gpipe.engine.microbatch.scatter`) over any collection:
    ``N`` is dim 0 of the first tensor that has one and is not marked with
    :func:`~lightning_gpipe.engine.microbatch.no_chunk`; every tensor of that dim 0 is split
    (``(N, *)`` → ``(n_i, *)``, larger parts first); other tensors (0-d, marked, another dim 0) and
    every other value reach each part whole.

    Raises:
        ValueError: the batch holds no tensor with a batch dimension.
    """
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    n = batch_dim(found)
    if not n:
        shapes = ", ".join(str(list(t.shape)) for t in found) or "none"
        raise ValueError(
            "one training_step per micro-batch splits the batch along dim 0, but it holds no tensor with a "
            f"batch dimension (shapes: {shapes}); "
            "give a tensor the batch dimension first, or use schedule='gpipe'"
        )
    parts = sizes(n, chunks, min_size)
    bounds = [sum(parts[:k]) for k in range(len(parts) + 1)]

    def part(t: Tensor, a: int, b: int) -> Tensor:
        return t[a:b] if is_split(t, n) else t

    micro = [apply_to_collection(batch, Tensor, part, a, b) for a, b in zip(bounds, bounds[1:])]
    return micro, parts


class MicroSteps:
    """Runs a training step as one user ``training_step`` call per micro-batch (see the module docstring).

    One instance per strategy: :meth:`training_step` in the strategy's ``training_step``,
    :meth:`finish` and :meth:`deposit` in its ``backward``.
    """

    def __init__(self) -> None:
        self._made: list[tuple[Tensor, Tensor | None]] = []  # (parameter, gradient made in the step)
        self._checked = False  # whether a step was checked for ignore_index targets without num_items

    def training_step(
        self,
        step: Callable[..., Any],
        stage: PipelineStage,
        module: Any,
        precision_plugin: Any,
        chunks: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Call ``step`` (the user's ``training_step``) once per micro-batch of the batch in ``args[0]``.

        Args:
            step: the user's step, called as ``step(micro_batch, *args[1:], **kwargs)``.
            stage: this rank's stage.
            module: the LightningModule (its ``log`` is recorded during the calls).
            precision_plugin: the strategy's precision plugin (its ``scaler``, if any, scales each loss).
            chunks: micro-batches per batch M.

        Returns:
            The combined output on the last stage; :class:`~lightning_gpipe.engine.stage.StageDone` on the
            others; the first call's output when it did not call the pipelined Sequential.

        Raises:
            PipelineUsageError: a call returned no loss on the last stage, or did not call the
                pipelined Sequential while the first did.
        """
        batch, rest = (args[0], args[1:]) if args else (kwargs.pop("batch"), ())
        micro, parts = split_batch(batch, chunks, stage.executor.min_micro_batch)
        trainer = _lightning.attached_trainer(module)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        params = list(module.parameters())
        kept: list[dict[str, Any] | None] = []  # each call's dict output less its loss (step_outputs)
        items: list[float | None] = []  # each call's num_items
        losses: list[Tensor] = []
        uncalled = None
        stage.start_micro_steps(len(micro), [n / sum(parts) for n in parts])
        metrics = step_metrics.isolate(module, stage)
        log = _LogRecorder(module, [h.metric for h in metrics])
        with self._own_gradients(params, [None] * len(params)), log:  # earlier steps' set aside
            for i, part in enumerate(micro):
                log.micro_batch = i
                out = stage.run_step(step, True, part, *rest, **kwargs)
                if not stage.ran_forward:
                    if i == 0:  # a step without the pipeline: the strategy decides as under "gpipe"
                        uncalled = (out,)
                        break
                    raise PipelineUsageError(
                        "training_step did not call the pipelined nn.Sequential "
                        f"for micro-batch {i} but did "
                        "for micro-batch 0; under a per-micro-batch schedule every call must call it once"
                    )
                if not stage.topology.is_last:
                    continue
                loss = out.get("loss") if isinstance(out, Mapping) else out
                if not isinstance(loss, Tensor):
                    raise PipelineUsageError(
                        f"training_step returned no loss for micro-batch {i} "
                        f"(got {type(out).__name__}); every process must backpropagate a "
                        "loss in every step (Lightning refuses None on more than one process, "
                        "under any strategy): to skip a batch, return a zero loss that keeps "
                        "the graph, e.g. `loss * 0` or `out.sum() * 0`, as under DDP"
                    )
                check_loss_graph(loss, stage.output_leaves(), module)  # before any backward of it
                losses.append(_kept(loss))
                kept.append(without_loss(out))
                items.append(num_items_of(out, i))
                weight = _weight(parts, items, len(micro)) / accumulate
                if weight:  # 0: a call with num_items 0, whose mean loss is NaN, adds nothing
                    _backward(loss * weight, precision_plugin, module)
                stage.loss_backpropagated(i)
                del out, loss  # nothing of a call outlives its backward but its loss value
            stage.end_micro_steps()
        step_metrics.rejoin(metrics)  # the metrics' step values: the batch's
        if uncalled is not None:
            log.replay(parts)
            return uncalled[0]
        if not stage.topology.is_last:
            log.replay(parts)
            return StageDone
        weights = loss_weights(parts, items)
        log.replay(weights, parts)
        if not self._checked:  # once: a count-normalised loss returned without its count
            self._checked = True
            _warn_ignored_targets(batch, items)
        stage.step_gradient_scale = gradient_scale(items, len(micro))[1]
        kept_loss = [(w, loss) for w, loss in zip(weights, losses) if w > 0]
        combined = torch.stack([loss.double() * w for w, loss in kept_loss]).sum() if kept_loss else None
        dtype = losses[0].dtype
        nan = torch.tensor(float("nan"), device=losses[0].device)
        loss_out = (combined if combined is not None else nan).to(dtype)
        loss_out = loss_out.requires_grad_(losses[0].is_floating_point())
        if kept[-1] is None:
            return loss_out
        extras = combine_outputs(kept, weights, parts)
        return {**extras, "loss": loss_out}

    def finish(self, drain: Callable[[], None]) -> None:
        """Run ``drain`` (the stage's :meth:`~lightning_gpipe.engine.stage.PipelineStage.backward`: the
        weight passes the last stage held for it) with the step's own gradients in the parameters'
        ``.grad``, so that what it computes joins the gradients the calls made."""
        with self._own_gradients([p for p, _ in self._made], [g for _, g in self._made]):
            drain()

    @contextmanager
    def _own_gradients(self, params: list[Tensor], grads: list[Tensor | None]) -> Iterator[None]:
        """Within: the ``params``' ``.grad`` are the step's own ``grads``, the gradients they held
        before set aside (accumulated by earlier steps); after: the step's own kept for
        :meth:`deposit`, those set aside back."""
        aside = [(p, p.grad) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            yield
        finally:
            self._made = [(p, p.grad) for p in params]
            for p, g in aside:
                p.grad = g

    def deposit(self, scale: float = 1.0) -> None:
        """Add the gradients made during the step's calls, times ``scale`` (the step outcome's
        :func:`.step_outputs.gradient_scale`), to the parameters' (in Lightning's ``backward``)."""
        made, self._made = self._made, []
        with torch.no_grad():
            for p, g in made:
                if g is None:
                    continue
                if scale != 1.0:
                    g.mul_(scale)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g


def _weight(parts: list[int], items: list[float | None], calls: int) -> float:
    """The weight of the last call's loss in its backward (:mod:`.step_outputs`): ``n_i / N``, or with
    ``num_items`` ``k_i / (M · k_ref)`` (0 for ``k_i = 0``).

    Raises:
        PipelineUsageError: this call returned ``num_items`` and the first did not, or the reverse.
    """
    i, k = len(items) - 1, items[-1]
    if (k is None) != (items[0] is None):
        loss_weights(parts[: i + 1], items)  # raises: num_items from some calls only
    if k is None:
        return parts[i] / sum(parts)
    ref = gradient_scale(items, calls)[0]
    return k / (calls * ref) if ref else 0.0


def _warn_ignored_targets(batch: Any, items: list[float | None]) -> None:
    """Warn (rank 0) that a batch with ``ignore_index`` targets trained without ``num_items``: its
    micro-batch means are weighted by samples, not by the targets they count."""
    if items[0] is None and ignores_targets(batch):
        rank_zero_warn(
            "the batch holds integer targets equal to -100 (ignore_index) and training_step returns no "
            "num_items: a loss that is a mean over the targets left (F.cross_entropy(..., "
            "ignore_index=-100)) is weighted per micro-batch by samples, not by targets, and trains "
            'differently from one device; return {"loss": loss, "num_items": (labels != -100).sum()} '
            "(docs/lightning.md, token-count losses)"
        )


def _backward(loss: Tensor, precision_plugin: Any, module: Any) -> None:
    """``loss``'s backward through the precision plugin, scaled by its ``GradScaler`` if it has one."""
    scaler = getattr(precision_plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler):
        loss = scaler.scale(loss)
    precision_plugin.backward(loss, module, None)


def _kept(value: Any) -> Any:
    """What a step keeps of a micro-batch's value to the end of the step: a tensor detached and copied.

    A loss is a scalar, but it may hold much more: ``F.mse_loss`` returns a 0-d view of its
    element-wise buffer (one micro-batch's output size), and its graph holds the output leaves
    and their gradients; a detached view would keep the buffer, an undetached value the graph,
    for every micro-batch, to the end of the step. A copy owns only its own elements.
    """
    return value.detach().clone() if isinstance(value, Tensor) else value


@functools.cache
def _log_signature(log: Callable[..., Any]) -> inspect.Signature:
    """The signature of a ``LightningModule.log`` (per function: a step's recorder binds each call)."""
    return inspect.signature(log)


class _LogRecorder:
    """Within: the module's ``log`` records ``(micro-batch, value, options)`` per name; :meth:`replay`
    then logs each name once with its combined value."""

    _REDUCE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "mean": lambda v, w: torch.where(w > 0, v * w, torch.zeros_like(v)).sum() / w.sum(),
        "sum": lambda v, w: v.sum(),
        "max": lambda v, w: v.max(),
        "min": lambda v, w: v.min(),
    }

    _warned: set[str] = set()  # names warned about (NaN from a one-sample micro-batch)

    def __init__(self, module: Any, metrics: Sequence[Any] = ()) -> None:
        self.module = module
        self.metrics = list(metrics)  # a value one of their forwards returned is logged as their batch value
        self.signature = _log_signature(type(module).log)
        self.records: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
        self.micro_batch = 0
        self._prior: Any = _MISSING

    def __enter__(self) -> _LogRecorder:
        self._prior = self.module.__dict__.get("log", _MISSING)
        self.module.__dict__["log"] = self._record
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prior is _MISSING:
            self.module.__dict__.pop("log", None)
        else:
            self.module.__dict__["log"] = self._prior

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = self.signature.bind(self.module, name, value, *args, **kwargs).arguments
        options = {k: v for k, v in options.items() if k not in ("self", "name", "value")}
        source = next((m for m in self.metrics if value is m._forward_cache), None) if self.metrics else None
        kept = (_FORWARD, source) if source is not None and isinstance(value, Tensor) else _kept(value)
        self.records.setdefault(name, []).append((self.micro_batch, kept, options))

    def replay(self, weights: Sequence[float], sizes: Sequence[int] | None = None) -> None:
        """Log every recorded name once through the module's ``log``, its values combined (module
        docstring); ``weights``: each call's weight in a mean (its ``n_i``, or its loss weight ``w_i``);
        ``sizes``: each call's micro-batch size ``n_i``, where a NaN from a one-sample micro-batch (a
        statistic such as ``std`` over one sample) is left out, with a warning once per name."""
        for name, entries in self.records.items():
            options = dict(entries[-1][2])
            values = [v for _, v, _ in entries]
            if options.get("batch_size") is not None:
                options["batch_size"] = sum(
                    int(o["batch_size"]) for _, _, o in entries if o.get("batch_size")
                )
            marked = [type(v) is tuple and v[0] is _FORWARD for v in values]
            if all(marked) and len({id(v[1]) for v in values}) == 1:  # a metric's: the batch's (step_metrics)
                self.module.log(name, values[-1][1]._forward_cache, **options)
                continue
            values = [v[1]._forward_cache if m else v for v, m in zip(values, marked)]
            if not all(isinstance(v, (Tensor, int, float)) for v in values):
                self.module.log(name, values[-1], **options)  # a Metric: the batch's step value
                continue
            reduce = options.get("reduce_fx", "mean")
            key = reduce if isinstance(reduce, str) else getattr(reduce, "__name__", "mean")
            tensors = [torch.as_tensor(v).detach() for v in values]
            calls = [i for i, _, _ in entries]
            if sizes is not None and 1 in sizes:
                calls, tensors = self._without_single_sample_nans(name, calls, tensors, sizes)
            device = tensors[0].device
            stacked = torch.stack([t.to(device, torch.float64) for t in tensors])
            w = torch.tensor([float(weights[i]) for i in calls], dtype=torch.float64, device=device)
            w = w.reshape(-1, *[1] * (stacked.dim() - 1))
            combined = self._REDUCE.get(key, self._REDUCE["mean"])(stacked, w)
            dtype = tensors[0].dtype if tensors[0].is_floating_point() else torch.get_default_dtype()
            self.module.log(name, combined.to(dtype), **options)

    def _without_single_sample_nans(
        self, name: str, calls: list[int], tensors: list[Tensor], sizes: Sequence[int]
    ) -> tuple[list[int], list[Tensor]]:
        """``calls`` and their ``tensors`` less the NaN values of one-sample micro-batches (all of them
        where every value is such a NaN: one device's value is NaN too)."""
        single = [
            sizes[i] == 1 and t.is_floating_point() and bool(t.isnan().any()) for i, t in zip(calls, tensors)
        ]
        if not any(single) or all(single):
            return calls, tensors
        if name not in _LogRecorder._warned:
            _LogRecorder._warned.add(name)
            rank_zero_warn(
                f"{name!r} logged NaN for a micro-batch of one sample (a statistic such as std over one "
                "sample): the step's value leaves it out and combines the other micro-batches'. A statistic "
                "of the batch is not a combination of its micro-batches': compute it per sample, or use "
                "more samples per micro-batch (a smaller chunks)"
            )
        kept = [(i, t) for i, t, s in zip(calls, tensors, single) if not s]
        return [i for i, _ in kept], [t for _, t in kept]
