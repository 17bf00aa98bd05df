"""One pipeline stage: the module that replaces the user's ``nn.Sequential`` on each rank.

:class:`PipelineStage` holds only this rank's layers, under their original names (so its
``state_dict`` keys are the user's), and runs this stage's column of the fill-drain schedule
(:mod:`lightning_gpipe.schedule`):

- forward (inside the user's step): split or receive micro-batches, compute each one
  (recomputable under ``torch.utils.checkpoint``), send it on. The last stage returns the whole
  mini-batch's output, micro-batches concatenated, as leaves detached from the pipeline's graph
  so that the user's loss backpropagates only to them; the other stages raise :class:`StageDone`
  to leave the user's step.
- backward (when Lightning calls ``backward``): in reverse micro-batch order, receive the output
  gradient from the next stage (on the last stage: split the leaves' gradients), backpropagate,
  send the input gradient to the previous stage.

- the loss message (after the user's step): the last stage tells the others whether the step
  has a loss, so that Lightning calls ``backward`` on every stage or on none.

Which micro-batches recompute their forward is :mod:`lightning_gpipe.recompute`'s rule.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe import recompute
from lightning_gpipe._compat import children
from lightning_gpipe.batchnorm import no_accumulate
from lightning_gpipe.comm import P2P, Meta
from lightning_gpipe.layout import Layout, StageTopology
from lightning_gpipe.microbatch import Batch, as_tensors, batch_size, from_tensors, join, split
from lightning_gpipe.partition import cut, layer_stages
from lightning_gpipe.skip import MicroBatchStore, routes, use_store


class StageDone(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Leaves the user's step on a non-last stage once its forward is done.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it; the strategy
    catches it around the step.
    """


class StageError(RuntimeError):
    """A layer of a stage raised; the message names the stage, its layers and the input's shapes."""


class PipelineUsageError(RuntimeError):
    """The pipelined module was used in a way the pipeline cannot run (e.g. called twice in a step)."""


@dataclass
class _Step:
    """What one step's forward keeps for its backward."""

    inputs: list[tuple[Tensor, ...]] = field(default_factory=list)
    outputs: list[tuple[Tensor, ...]] = field(default_factory=list)
    leaves: tuple[Tensor, ...] = ()  # last stage: the detached, joined outputs given to the user
    skips_in: list[dict[str, Tensor]] = field(default_factory=list)  # per micro-batch, received skips
    skips_out: list[dict[str, Tensor]] = field(default_factory=list)  # per micro-batch, skips sent on


class PipelineStage(nn.Sequential):
    """This rank's partition of the pipelined ``nn.Sequential``, executing its schedule column.

    Args:
        layers: ``(name, layer)`` pairs of this stage, names as in the user's Sequential.
        topology: stage index, stage count and neighbour ranks.
        chunks: number of micro-batches M (≥ 1).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        p2p: the transport.

    Shapes: the first stage takes ``(N, *)`` (or a tuple of such) and splits it into
    ``min(M, N) × (≈N/M, *)``; the last stage returns ``(N, *)`` outputs.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        topology: StageTopology,
        chunks: int,
        checkpoint: str,
        p2p: P2P,
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__(OrderedDict(layers))
        self.names = list(names) if names is not None else [n for n, _ in layers]  # of the whole Sequential
        self.topology = topology
        self.chunks = chunks
        self.checkpoint_mode = checkpoint
        self.p2p = p2p
        self.expect_backward = False  # set by the strategy around training_step
        self.active = False  # set by the strategy around every step
        self.calls = 0
        self._step: _Step | None = None
        self.timeline: Any = None  # a lightning_gpipe.timeline.Timeline, or None
        me = topology.stage
        self._skips_in = [r for r in topology.skips if r.target == me and r.source != me]
        self._skips_out = [r for r in topology.skips if r.source == me and r.target != me]
        self.received_skips: list[tuple[str, int]] = []  # (name, source stage), for inspection and tests

    @property
    def layer_names(self) -> list[str]:
        """Names of this stage's layers, as in the user's Sequential."""
        return list(self._modules)

    def __getitem__(self, idx: Any) -> Any:
        """``layers[k]`` with ``k`` the layer's index in the user's whole Sequential.

        Raises:
            PipelineUsageError: layer ``k`` lives on another stage, or ``idx`` is a slice.
        """
        if isinstance(idx, slice):
            raise PipelineUsageError(
                "slicing the pipelined nn.Sequential is not supported under the gpipe strategy: each process "
                f"holds only its stage's layers ({', '.join(self._modules)})"
            )
        index = int(idx) + len(self.names) if int(idx) < 0 else int(idx)
        if 0 <= index < len(self.names) and self.names[index] in self._modules:
            return self._modules[self.names[index]]
        raise PipelineUsageError(
            f"layer {idx} of the pipelined nn.Sequential lives on another stage: this process runs stage "
            f"{self.topology.stage}, which holds layers {', '.join(self._modules)}; access a layer only "
            "where it lives, or outside fit (the Sequential is whole again afterwards)"
        )

    def _span(self, kind: str, i: int) -> Any:
        """Record ``kind`` (forward, recompute, backward, send, recv) of micro-batch ``i`` on the timeline."""
        return self.timeline.span(kind, i) if self.timeline is not None else nullcontext()

    # -- the forward fill -------------------------------------------------------------------

    def begin_step(self, expect_backward: bool) -> None:
        """Called by the strategy before a user step; ``expect_backward`` for training steps."""
        self.active = True
        self.calls = 0
        self.expect_backward = expect_backward
        self._step = None

    def end_step(self) -> None:
        self.active = False

    def run_step(self, step: Callable[..., Any], expect_backward: bool, *args: Any, **kwargs: Any) -> Any:
        """``step(*args, **kwargs)`` (a user step calling this stage) between :meth:`begin_step` and
        :meth:`end_step`; :class:`StageDone` itself is returned where a non-last stage left the step."""
        self.begin_step(expect_backward)
        try:
            return step(*args, **kwargs)
        except StageDone:
            return StageDone
        finally:
            self.end_step()

    @property
    def ran_forward(self) -> bool:
        return self.calls > 0

    def local_forward(self, input: Batch, store: MicroBatchStore | None = None) -> Any:
        """This stage's layers applied in order, as ``nn.Sequential`` would, with ``store`` for skips."""
        with use_store(store if store is not None else MicroBatchStore()):
            for layer in self:
                input = layer(input)
        return input

    def forward(self, input: Batch) -> Any:  # noqa: A002 - nn.Sequential's own argument name
        if not self.active:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called outside training/validation/test/predict_step; "
                "under the gpipe strategy it runs only inside the LightningModule's step methods"
            )
        if self.calls:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called twice in one step; the gpipe strategy runs one "
                "forward per step (concatenate the inputs and call it once)"
            )
        self.calls += 1
        top = self.topology
        train = self.expect_backward and torch.is_grad_enabled()
        step = _Step() if train else None

        if top.is_first:
            tensors, in_tuple = as_tensors(input, "input of the pipelined nn.Sequential")
            micro_batches = split(tensors, self.chunks)
        count: int | None = len(micro_batches) if top.is_first else None
        outputs: list[tuple[Tensor, ...]] = []
        out_tuple = False
        i = 0
        while count is None or i < count:
            if top.is_first:
                x, x_tuple = micro_batches[i], in_tuple
            else:
                assert top.prev_rank is not None
                with self._span("recv", i):
                    meta, received = self.p2p.recv(top.prev_rank)
                count = meta.count
                if i == 0:  # the rest of this forward's messages arrive while the stage computes
                    for src, n in self._forward_messages(count).items():
                        self.p2p.expect(src, n)
                x, x_tuple = _as_inputs(meta, received, train), meta.is_tuple
            assert count is not None
            store = MicroBatchStore()
            for route in self._skips_in:
                with self._span("recv", i):
                    meta, (skip,) = self.p2p.recv(top.ranks[route.source])
                store[route.name] = _as_inputs(meta, [skip], train)[0]
                self.received_skips.append((route.name, route.source))
            with self._span("forward", i), self._naming_errors("forward", i, x):
                y = self._compute(i, count, from_tensors(x, x_tuple), train, store)
            y_tensors, out_tuple = as_tensors(y, f"output of pipeline stage {top.stage}")
            if step is not None:
                step.inputs.append(x)
                step.outputs.append(y_tensors)
                step.skips_in.append({r.name: store[r.name] for r in self._skips_in})
                step.skips_out.append({r.name: store[r.name] for r in self._skips_out})
            if top.is_last:
                outputs.append(y_tensors)
            else:  # the output first, then the skips: the order in which the next stage receives them
                assert top.next_rank is not None
                with self._span("send", i):
                    self.p2p.send(y_tensors, top.next_rank, is_tuple=out_tuple, count=count)
            for route in self._skips_out:
                with self._span("send", i):
                    self.p2p.send([store[route.name]], top.ranks[route.target], count=count)
            i += 1

        self._step = step
        if not top.is_last:
            self.p2p.flush()
            raise StageDone
        batch_size(
            outputs[0], f"output of the last pipeline stage ({top.stage})"
        )  # a scalar cannot be joined
        joined = join(outputs)
        if step is not None:
            joined = tuple(t.detach().requires_grad_(t.requires_grad) for t in joined)
            step.leaves = joined
        return from_tensors(joined, out_tuple)

    def _compute(self, i: int, count: int, x: Batch, train: bool, store: MicroBatchStore) -> Any:
        if not (train and recompute.recomputes(self.checkpoint_mode, i, count)):
            return self.local_forward(x, store)
        return recompute.run(self.local_forward, x, store, context=lambda: self._recompute_context(i))

    @contextmanager
    def _naming_errors(self, phase: str, i: int, x: Sequence[Tensor]) -> Iterator[None]:
        """Re-raise an error of this stage's layers as a :class:`StageError` naming stage, layers and shapes."""
        try:
            yield
        except (StageError, PipelineUsageError):
            raise
        except Exception as err:
            top = self.topology
            names = list(self._modules)
            source = "the batch" if top.is_first else f"stage {top.stage - 1}"
            shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in x)
            expects = _expected_input(next(iter(self), None))
            raise StageError(
                f"stage {top.stage} (layers {names[0]}..{names[-1]}) failed in {phase} of micro-batch {i} "
                f"on input from {source} of shape [{shapes}]{expects}: {type(err).__name__}: {err}"
            ) from err

    @contextmanager
    def _recompute_context(self, i: int) -> Iterator[None]:
        with self._span("recompute", i), recompute.no_running_stats_update(self), no_accumulate():
            yield

    def _forward_messages(self, count: int) -> Counter[int]:
        """Messages still to come, per source rank, in a forward whose first input has arrived."""
        top = self.topology
        assert top.prev_rank is not None
        per_micro_batch = Counter([top.prev_rank] + [top.ranks[r.source] for r in self._skips_in])
        expected = Counter({src: n * count for src, n in per_micro_batch.items()})
        expected[top.prev_rank] -= 1
        return expected

    # -- the loss message -------------------------------------------------------------------

    def share_loss(self, out: Any) -> Any:
        """The last stage tells the others whether the step has a loss (and its value).

        Call after a training step whose forward ran. On the last stage ``out`` is the user's
        step output and is returned; it sends float64 ``[has_loss, value]`` to every other stage
        of its pipeline. The others return that value as a scalar that requires grad (so that
        Lightning calls ``backward`` on every stage), or ``None`` when the step has no loss (a
        ``training_step`` returning ``None``; Lightning itself refuses that when several
        processes run), and then drop what the forward kept.
        """
        top = self.topology
        if top.stages == 1:
            return out
        if top.is_last:
            loss = out.get("loss") if isinstance(out, dict) else out
            has = isinstance(loss, Tensor)
            value = float(loss.detach().float()) if isinstance(loss, Tensor) and loss.numel() == 1 else 0.0
            message = torch.tensor([float(has), value], dtype=torch.float64, device=self.p2p.device)
            for rank in top.ranks[:-1]:
                self.p2p.send([message], rank)
            if not has:
                self.p2p.flush()
                self.backward_skipped()
            # else the backward's own flush waits for these sends: the drain starts now
            return out
        _, (message,) = self.p2p.recv(top.ranks[-1])
        has, value = message.tolist()
        if not has:
            self.backward_skipped()
            return None
        return torch.tensor(value, device=self.p2p.device, requires_grad=True)

    # -- the backward drain -----------------------------------------------------------------

    def _backward_messages(self, step: _Step) -> Counter[int]:
        """Gradient messages a backward will receive, per source rank (the order :meth:`backward` takes them)."""
        top = self.topology
        expected: Counter[int] = Counter()
        for i, y in enumerate(step.outputs):
            if not top.is_last and any(t.requires_grad for t in y):
                assert top.next_rank is not None
                expected[top.next_rank] += 1
            for route in self._skips_out:
                if step.skips_out[i][route.name].requires_grad:
                    expected[top.ranks[route.target]] += 1
        return expected

    def backward_skipped(self) -> None:
        """The step has no loss (the user's step returned ``None``): drop what the forward kept."""
        self._step = None

    def backward(self) -> None:
        """Run this stage's backwards in reverse micro-batch order; a no-op if no forward needs one."""
        step, self._step = self._step, None
        if step is None:
            return
        top = self.topology
        count = len(step.outputs)
        if top.is_last:
            sizes = [o[0].shape[0] for o in step.outputs]
            grads = [
                (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).split(sizes)
                for leaf in step.leaves
                if leaf.requires_grad
            ]
        for src, n in self._backward_messages(step).items():
            self.p2p.expect(src, n)
        for i in reversed(range(count)):
            y = step.outputs[i]
            y_grad = [t for t in y if t.requires_grad]
            skips_out = [(r, step.skips_out[i][r.name]) for r in self._skips_out]
            if top.is_last:
                dy = [g[i] for g in grads]
            elif y_grad:
                assert top.next_rank is not None
                with self._span("recv", i):
                    _, dy = self.p2p.recv(top.next_rank)
            else:
                dy = []
            for route, skip in skips_out:  # gradients of skips this stage sent on come straight back
                if skip.requires_grad:
                    with self._span("recv", i):
                        _, (skip_grad,) = self.p2p.recv(top.ranks[route.target])
                    y_grad, dy = [*y_grad, skip], [*dy, skip_grad]
            if y_grad:
                with self._span("backward", i), self._naming_errors("backward", i, step.inputs[i]):
                    torch.autograd.backward(y_grad, dy)
            if not top.is_first:
                x_grad = [t for t in step.inputs[i] if t.requires_grad]
                if x_grad:
                    assert top.prev_rank is not None
                    dx = [t.grad if t.grad is not None else torch.zeros_like(t) for t in x_grad]
                    with self._span("send", i):
                        self.p2p.send(dx, top.prev_rank, count=count)
            for route in self._skips_in:
                skip = step.skips_in[i][route.name]
                if skip.requires_grad:
                    grad = skip.grad if skip.grad is not None else torch.zeros_like(skip)
                    with self._span("send", i):
                        self.p2p.send([grad], top.ranks[route.source], count=count)
            step.inputs[i] = step.outputs[i] = ()  # free this micro-batch
            step.skips_in[i] = step.skips_out[i] = {}
        self.p2p.flush()


def build_stage(
    seq: nn.Sequential,
    balance: Sequence[int],
    layout: Layout,
    rank: int,
    chunks: int,
    checkpoint: str,
    device: torch.device,
) -> PipelineStage:
    """Global rank ``rank``'s :class:`PipelineStage` of ``seq`` cut by ``balance`` (layers shared, not copied)."""
    topology = layout.topology(rank, tuple(routes(seq, layer_stages(balance))))
    layers = cut(seq, balance, topology.stage)
    return PipelineStage(layers, topology, chunks, checkpoint, P2P(device), list(children(seq)))


def _as_inputs(meta: Meta, received: list[Tensor], train: bool) -> tuple[Tensor, ...]:
    """Received activations: floating tensors the sender tracks gradients for get ``requires_grad``."""
    return tuple(
        t.requires_grad_(train and rg and t.is_floating_point())
        for t, (_, _, rg) in zip(received, meta.specs)
    )


def _expected_input(layer: nn.Module | None) -> str:
    """What the stage's first layer expects, when the layer says (Linear, Conv, Embedding, norms)."""
    for attr, what in (
        ("in_features", "(*, {})"),
        ("in_channels", "(N, {}, ...)"),
        ("num_features", "(N, {}, ...)"),
    ):
        value = getattr(layer, attr, None)
        if isinstance(value, int):
            return f"; its first layer ({type(layer).__name__}) expects {what.format(value)}"
    return ""
