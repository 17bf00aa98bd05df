"""One pipeline stage: the module that replaces the user's ``nn.Sequential`` on each rank.

:class:`PipelineStage` holds only this rank's layers, under their original names (so its
``state_dict`` keys are the user's), and executes this stage's column of a schedule
(:mod:`lightning_gpipe.schedule`, :func:`~lightning_gpipe.schedule.fill_drain` by default) in
order, as a cursor: it runs its actions while they are runnable and stops where an action waits
for something only the user's code provides. ``F i`` runs inside the user's call of the
Sequential that gives micro-batch ``i`` (on the first stage, its input; on the last stage, the
call returns its output); ``B i`` needs micro-batch ``i``'s loss. Receives only block on peers.
Two contracts drive the cursor:

- one call per step (``schedule="gpipe"``): the call covers every micro-batch and the step's
  loss exists once the user's step has returned, so the column runs in two phases
  (:func:`~lightning_gpipe.schedule.split_phases`): the forward phase inside the user's step,
  the backward phase when Lightning calls ``backward``;
- one call per micro-batch (:meth:`PipelineStage.start_micro_steps`, the other schedules,
  :mod:`lightning_gpipe.strategy.microstep`): call ``i`` gives micro-batch ``i``; on the last stage
  ``B i`` runs once the strategy has backpropagated micro-batch ``i``'s loss into its output
  (:meth:`PipelineStage.loss_backpropagated`); the other stages' backwards wait only for their
  gradients, so a 1F1B column interleaves forwards and backwards inside the calls.

In order, within a step:

- the forward of a call: the first stage splits the mini-batch into micro-batches (one call
  per step) or takes the call's micro-batch, the others learn M from the first message's
  header; then each runnable action runs. ``F i``: receive micro-batch ``i`` (and its skips),
  compute it (recomputable under ``torch.utils.checkpoint``), send it on. The last stage returns
  the call's output, its micro-batches concatenated, as leaves detached from the pipeline's
  graph so that the user's loss backpropagates only to them; the other stages raise
  :class:`StageDone` to leave the user's step.
- ``B i``: receive the output's gradient (on the last stage: split the leaves' gradients),
  backpropagate, send the input's gradient.
- the step outcome (after the user's step, :meth:`PipelineStage.share_outcome`,
  :mod:`lightning_gpipe.engine.outcome`): the last stage tells the others whether the step has a loss,
  so that Lightning calls ``backward`` on every stage or on none, with
  ``trainer.callback_metrics`` and ``should_stop``. One call per step: it comes between the
  forward and the backward phase; one call per micro-batch: after every action.

Every receive and send is one that :func:`~lightning_gpipe.schedule.receives` and
:func:`~lightning_gpipe.schedule.sends` name for the action, received when the action runs.
Which micro-batches recompute their forward is :mod:`lightning_gpipe.engine.recompute`'s rule;
the recompute runs on the module state its forward saw and changes nothing
(:class:`~lightning_gpipe.engine.recompute.ForwardState`).

Virtual stages (``schedule="interleaved_1f1b"``, :func:`~lightning_gpipe.schedule.interleaved_1f1b`):
the stage holds parts ``j, j+K, …`` of the Sequential (:attr:`PipelineStage.virtual_layers`), an
action runs its virtual stage's layers, and what the forward keeps is kept per (micro-batch,
virtual stage). The part that takes the user's input (stage 0's virtual stage 0) and the part whose
output a call returns (the last stage's last virtual stage) wait for their call; the last stage's
other forwards run ahead of the calls. Where the grid's stages take a peer's messages in another
order than the peer's column sends them (:func:`~lightning_gpipe.schedule.in_send_order`), each
send waits until the messages the peer takes before it have gone, so a peer's messages always
arrive in the order they are taken.

Where it lives: this module is the stage's module face (the layers under the user's names, the
calls, the step's contracts); the column runs in the stage's
:class:`~lightning_gpipe.engine.executor.ColumnExecutor`, over one step's state
(:mod:`lightning_gpipe.engine.plan`, kept per (micro-batch, virtual stage)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_gpipe import schedule
from lightning_gpipe._compat import children
from lightning_gpipe.engine.executor import ColumnExecutor
from lightning_gpipe.engine.microbatch import gather, scatter, unflatten
from lightning_gpipe.engine.outcome import OutcomeChannel, apply_outcome, outcome_of
from lightning_gpipe.engine.plan import Call, StepRun
from lightning_gpipe.engine.rng import StageGenerator
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.schedule import Grid
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P


class StageDone(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Leaves the user's step on a non-last stage once its forward is done.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it; the strategy
    catches it around the step.
    """


class PipelineStage(nn.Sequential):
    """This rank's partition of the pipelined ``nn.Sequential``, executing its schedule column.

    Args:
        layers: ``(name, layer)`` pairs of this stage, names as in the user's Sequential.
        topology: stage index, stage count and neighbour ranks.
        chunks: number of micro-batches M (≥ 1).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        p2p: the transport.
        names: layer names of the user's whole Sequential (for indexing by its indices).
        schedule: ``(stages, chunks) -> Grid`` (default: :func:`~lightning_gpipe.schedule.fill_drain`).
        virtual_layers: with virtual stages, the names of each virtual stage's layers, in order
            (stage ``j``'s virtual stage ``u`` holds part ``j + u·K``:
            :func:`~lightning_gpipe.partition.cut.virtual_cut`); default: one virtual stage holding
            every layer. The stage holds all of them under the user's names either way.
        calls: how a layer is applied where not as ``layer(x)``: ``name -> call(layer, x)`` (a plan's
            parts that pass several named tensors, :class:`~lightning_gpipe.partition.part_call.PartCall`).

    Names may be dotted (``"blocks.3"``: a plan's part, :mod:`lightning_gpipe.partition.plan`): the
    ``state_dict`` keys are then the plan root's own (``blocks.3.attn.qkv.weight``).

    Shapes: the first stage takes ``(N, *)`` (or a tuple, or any pytree:
    :mod:`lightning_gpipe.engine.microbatch`) and splits it into ``min(M, N) × (≈N/M, *)``; the last stage
    returns ``(N, *)`` outputs (replicated leaves as they are).
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        topology: StageTopology,
        chunks: int,
        checkpoint: str,
        p2p: P2P,
        names: Sequence[str] | None = None,
        schedule: Callable[[int, int], Grid] = schedule.fill_drain,
        virtual_layers: Sequence[Sequence[str]] | None = None,
        calls: dict[str, Callable[[nn.Module, Any], Any]] | None = None,
    ) -> None:
        super().__init__()
        children(self).update(layers)  # add_module would refuse a plan's dotted names
        self.names = list(names) if names is not None else [n for n, _ in layers]  # of the whole Sequential
        held = [n for n, _ in layers]
        self.virtual_layers = [list(v) for v in virtual_layers] if virtual_layers is not None else [held]
        if sorted(n for v in self.virtual_layers for n in v) != sorted(held):
            raise ValueError(
                f"the virtual stages' layers ({self.virtual_layers}) are not the stage's layers ({held})"
            )
        self.topology = topology
        self.chunks = chunks
        self.checkpoint_mode = checkpoint
        self.expect_backward = False  # set by the strategy around training_step
        self.active = False  # set by the strategy around every step
        self.schedule = schedule
        self.calls = 0
        self.configuring = False  # set by the strategy around configure_optimizers
        # set by the strategy: every training step ends with the last stage's outcome (share_outcome)
        self.outcomes = OutcomeChannel(p2p, p2p.device)
        generator = StageGenerator(p2p.device, topology.stage)  # what the layers draw
        self.executor = ColumnExecutor(
            self._modules, self.virtual_layers, topology, chunks, checkpoint, p2p, schedule, generator, calls
        )
        # one call per micro-batch: what the user's code draws after the call on the last stage
        self.after_call = StageGenerator(p2p.device, topology.stages)
        self._run: StepRun | None = None  # the step in progress
        self._micro: int | None = None  # one call per micro-batch: their number in this step
        # the factor the step's gradients take (lightning_gpipe.strategy.step_outputs), shared in the outcome
        self.step_gradient_scale = 1.0
        self.micro_weights: list[float] = []  # one call per micro-batch: each one's share of the batch
        # FSDP under zb_h1 (lightning_gpipe.strategy.sharding): called once a training step's column has run
        self.after_backward: Callable[[], None] | None = None

    @property
    def p2p(self) -> P2P:
        """The stage's transport (its executor's)."""
        return self.executor.p2p

    @p2p.setter
    def p2p(self, p2p: P2P) -> None:
        self.executor.p2p = p2p

    @property
    def timeline(self) -> Any:
        """A :class:`~lightning_gpipe.tools.timeline.Timeline` (anything with ``span(kind, i, u)``),
        or ``None``."""
        return self.executor.timeline

    @timeline.setter
    def timeline(self, timeline: Any) -> None:
        self.executor.timeline = timeline

    @property
    def received_skips(self) -> list[tuple[str, int]]:
        """``(name, source stage)`` of every skip received, for inspection."""
        return self.executor.received_skips

    @property
    def virtual_stages(self) -> int:
        """v: the virtual stages this stage holds (1 without)."""
        return len(self.virtual_layers)

    @property
    def layer_names(self) -> list[str]:
        """Names of this stage's layers, as in the user's Sequential."""
        return list(self._modules)

    def compile(self, compile_fn: Any) -> None:  # type: ignore[override]
        """Run each virtual stage's layers through ``compile_fn(nn.Sequential of the layers)`` (e.g.
        ``torch.compile``).

        The compiled module shares the layers (parameters, buffers); it is kept outside the
        stage's submodules, so ``state_dict`` keys stay the user's.
        """
        self.executor.compiled = [
            compile_fn(nn.Sequential(*[self._modules[n] for n in names])) for names in self.virtual_layers
        ]

    def __iter__(self) -> Iterator[nn.Module]:
        """The stage's layers; inside a step, iterating raises: the pipeline runs one call per step.

        Raises:
            PipelineUsageError: iterated inside a step (``for layer in self.layers: ...``), where
                this process holds only its stage's layers.
        """
        if self.active:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was iterated inside a step (for layer in ...); under the gpipe "
                f"strategy this process holds only stage {self.topology.stage}'s layers "
                f"({', '.join(self._modules)}) and the pipeline runs one forward per step: call the "
                "Sequential once (self.layers(x))"
            )
        return iter(self._modules.values())

    def __getitem__(self, idx: Any) -> Any:
        """``layers[k]`` with ``k`` the layer's index in the user's whole Sequential.

        While the optimizers are configured (``configure_optimizers``), a layer on another stage is
        an empty module and a slice an ``nn.Sequential`` of this stage's layers within it, so that
        one-device code such as ``{"params": self.layers[-1].parameters(), "lr": ...}`` builds the
        same groups, empty where the stage holds none of their layers.

        Raises:
            PipelineUsageError: otherwise, layer ``k`` lives on another stage, or ``idx`` is a slice.
        """
        if isinstance(idx, slice):
            if self.configuring:
                wanted = self.names[idx]
                held = nn.Sequential()
                children(held).update((n, m) for n, m in self._modules.items() if n in wanted)
                return held
            raise PipelineUsageError(
                "slicing the pipelined nn.Sequential is not supported under the gpipe strategy outside "
                "configure_optimizers: each process holds only its stage's layers "
                f"({', '.join(self._modules)})"
            )
        index = int(idx) + len(self.names) if int(idx) < 0 else int(idx)
        if 0 <= index < len(self.names) and self.names[index] in self._modules:
            return self._modules[self.names[index]]
        if self.configuring and 0 <= index < len(self.names):
            return nn.Module()  # held by another stage: no parameters here
        raise PipelineUsageError(
            f"layer {idx} of the pipelined nn.Sequential lives on another stage: this process runs stage "
            f"{self.topology.stage}, which holds layers {', '.join(self._modules)}; access a layer only "
            "where it lives, or outside fit (the Sequential is whole again afterwards). To set a mode or "
            "freeze layers (m.eval(), m.requires_grad_(False)), loop over self.layers or self.modules(): "
            "each stage sees its own layers. A term over its "
            "weights or outputs belongs in its forward, declared with lightning_gpipe.aux_loss; in "
            "on_after_backward and on_before_optimizer_step, self.named_parameters() is the whole model's"
        )

    # -- the forward phase ------------------------------------------------------------------

    def begin_step(self, expect_backward: bool) -> None:
        """Called by the strategy before a user step; ``expect_backward`` for training steps."""
        self.active = True
        self.calls = 0
        self.expect_backward = expect_backward
        if self._micro is None:  # a step's calls start its run afresh
            self._run = None

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
            self.after_call.leave()
            self.end_step()

    def output_leaves(self) -> list[torch.Tensor]:
        """Last stage, in a training step: the leaves its calls returned whose gradients are still due."""
        return [t for call in self._run.calls for t in call.leaves] if self._run is not None else []

    @property
    def ran_forward(self) -> bool:
        return self.calls > 0

    @property
    def training_micro_batches(self) -> int:
        """M of the training step whose run is in progress (its micro-batches); 0 outside one (evaluation)."""
        run = self._run
        return run.chunks if run is not None and run.train else 0

    def forward(self, input: Any) -> Any:  # noqa: A002 - nn.Sequential's own argument name
        if not self.active:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called outside training/validation/test/predict_step; "
                "under the gpipe strategy it runs only inside the LightningModule's step methods, each "
                "rank holding one stage. To run the model on samples (e.g. a callback logging "
                "predictions): call it in validation_step or predict_step (the output is on the last "
                "stage), use trainer.predict(model, dataloaders) (the predictions reach every rank), or "
                "call it in on_fit_end or after trainer.fit returns, where the module is whole again "
                "on every rank"
            )
        if self.calls:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called twice in one step; the gpipe strategy runs one "
                "forward per step (concatenate the inputs and call it once)"
            )
        self.calls += 1
        top = self.topology
        train = self.expect_backward and torch.is_grad_enabled()
        run = self._run if self._micro is not None else None
        if run is None:
            run = self._run = self.executor.start(input, train, self._micro)
            run.aux_weights = self.micro_weights if self._micro is not None else None
        elif top.is_first:
            (run.micro_batches[run.called],), run.in_structures[run.called] = scatter(input, 1)
        if run.called == run.chunks:
            raise PipelineUsageError(
                "the pipelined nn.Sequential was called for more micro-batches than the step has "
                f"({run.chunks})"
            )
        covered = list(range(run.called, run.chunks if run.whole else run.called + 1))
        run.called = covered[-1] + 1
        self._advance(run)
        if not top.is_last:
            raise StageDone
        last = self.virtual_stages - 1
        outputs = [run.outputs[(i, last)] for i in covered]
        structures = [run.out_structures[(i, last)] for i in covered]
        joined, structure = gather(outputs, structures, f"output of the last pipeline stage ({top.stage})")
        if train:
            joined = tuple(t.detach().requires_grad_(t.requires_grad) for t in joined)
            sizes = [[o[k].shape[0] if o[k].dim() else 1 for o in outputs] for k in range(len(joined))]
            run.calls.append(Call(covered, sizes, joined, structure.whole))
        if self._micro is not None:  # the code after the call runs here only: its own stream (stage_rng)
            self.after_call.enter()
        return unflatten(structure, joined)

    def _advance(self, run: StepRun) -> None:
        """Run ``run``'s column while its actions are runnable; a finished run is the step's no longer."""
        self.executor.advance(run)
        if run.done:
            self._run = None
            if run.train and self.after_backward is not None:
                self.after_backward()

    # -- the step outcome --------------------------------------------------------------------

    def share_outcome(self, out: Any, trainer: Any, training: bool) -> Any:
        """The last stage sends its step outcome to the other stages, which install it
        (:mod:`lightning_gpipe.engine.outcome`).

        Call after a step whose forward ran, before Lightning runs any hook. On the last stage
        ``out`` is the user's step output and is returned; it sends whether the step has a loss
        (and its value), ``trainer.should_stop``, ``trainer.callback_metrics``, the step's
        :attr:`step_gradient_scale` and what the step returned besides its loss to every other stage
        of its pipeline. After a training step the others return the loss value as a scalar that
        requires grad (so that Lightning calls ``backward`` on every stage), in a dict with the last
        stage's other entries where it returned a dict, or ``None`` when the step has no loss (a
        ``training_step`` returning ``None``; Lightning itself refuses that when several processes
        run), and then drop what the forward kept; after an evaluation step, the last stage's output.
        """
        top = self.topology
        if top.stages == 1:
            return out
        self.outcomes.p2p = self.p2p  # the stage's transport, whichever it holds now
        if top.is_last:
            outcome = outcome_of(trainer, out, training, self.step_gradient_scale)
            for rank in top.ranks[:-1]:
                self.outcomes.send(outcome, rank)
            if not (training and outcome.has_loss):
                self.p2p.flush()
                self.backward_skipped()
            # else the backward's own flush waits for these sends: the drain starts now
            return out
        outcome = self.outcomes.receive(top.ranks[-1])
        apply_outcome(trainer, outcome)
        self.step_gradient_scale = outcome.gradient_scale
        if not training:
            return outcome.outputs
        if not outcome.has_loss:
            self.backward_skipped()
            return None
        loss = torch.tensor(outcome.loss, device=self.p2p.device, requires_grad=True)
        return {**outcome.outputs, "loss": loss} if isinstance(outcome.outputs, dict) else loss

    # -- the backward phase -----------------------------------------------------------------

    def backward_skipped(self) -> None:
        """The step has no loss (the user's step returned ``None``): drop what the forward kept."""
        self._run = None

    def backward(self) -> None:
        """Lightning's ``backward``: with one call per step, run this stage's backward phase (in
        reverse micro-batch order under fill-drain); with one call per micro-batch, the weight passes
        the last stage held for it (:attr:`~lightning_gpipe.engine.plan.ColumnPlan.drain_start`; the
        backwards ran with the calls). Waits for every send posted."""
        run = self._run if self._micro is None else None
        if run is None:
            self.p2p.flush()
            return
        run.step_loss = True
        self._advance(run)

    # -- one call per micro-batch (lightning_gpipe.strategy.microstep) --------------------------------

    def start_micro_steps(self, chunks: int, weights: list[float] | None = None) -> None:
        """The next ``chunks`` training calls are one step's micro-batches ``0 .. chunks-1``, one each;
        ``weights``: each one's share of the batch, which its aux losses take (default: equal).

        Between them the strategy backpropagates each micro-batch's loss (last stage) and calls
        :meth:`loss_backpropagated`; :meth:`end_micro_steps` closes the step, then every stage
        runs :meth:`share_outcome` (its receive posted during the step) and :meth:`backward`.
        """
        self._micro, self._run, self.step_gradient_scale = chunks, None, 1.0
        self.micro_weights = weights if weights is not None else [1.0 / chunks] * chunks

    def loss_backpropagated(self, i: int) -> None:
        """Last stage: micro-batch ``i``'s loss has reached its output leaves; run ``B i`` and what
        follows."""
        run = self._run
        if run is None or i in run.losses or i >= run.called:
            raise RuntimeError(f"micro-batch {i} has no forward waiting for its loss on this stage")
        run.losses.add(i)
        self._advance(run)

    def end_micro_steps(self) -> None:
        """Close a step run with :meth:`start_micro_steps`: its column must have run to the end, or
        to the weight passes held for :meth:`backward`.

        Raises:
            PipelineUsageError: the column stopped early (a call of the step did not call the
                Sequential, or a loss never came back), naming the action it waits at.
        """
        run, self._micro = self._run, None
        held = run is not None and not run.done and run.pos == run.plan.drain_start
        self._run = run if held else None
        if run is not None and not run.done and not held:
            waiting = run.column[run.pos]
            raise PipelineUsageError(
                f"stage {self.topology.stage} stopped at {waiting} of its column with {run.called} of "
                f"{run.chunks} micro-batches called; every training_step call must call the pipelined "
                "nn.Sequential once and return a loss"
            )
