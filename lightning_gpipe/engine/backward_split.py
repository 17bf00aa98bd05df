"""The input gradient first: a backward split into the gradient of the stage's inputs, sent at once,
and the gradients of its weights, computed after (the B/W split of Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 2).

Two uses, one mechanism (:class:`Split`):

- the drain of every schedule: a stage's last backward of a step that sends a gradient sends it
  before its weight gradients are computed, so the stage before it starts its own last backward
  about one weight-gradient pass earlier;
- ``schedule="zb_h1"`` (:func:`lightning_gpipe.schedule.zb_h1`): every ``B i`` computes the
  input gradient only and the schedule's ``W i`` computes the weight gradients later, where the
  stage would otherwise idle.

The split walks the autograd graph of the micro-batch once (:meth:`Split.of`). The nodes from which
a stage input can be reached (the *input chain*) run in the first pass, ``torch.autograd.grad`` to
the inputs with the graph kept; for each parameter, the walk from the parameter towards the outputs
stops at the first nodes of the input chain (its *frontier*), whose incoming gradients the first
pass records (node pre-hooks). The second pass runs ``torch.autograd.backward`` from those nodes
with the recorded gradients to the parameters, one group of parameters at a time (the parameters
that share frontier nodes: a layer's weight and bias, a weight used by two layers), so that the
input chain runs once and each parameter's gradient is accumulated into ``.grad`` as a single
backward does (post-accumulate hooks fire). Torch's ``torch.distributed.pipelining`` splits its
zero-bubble backwards the same way (``stage_backward_input`` / ``stage_backward_weight``).

The second pass starts each frontier node from the gradient the first recorded there (a pre-hook
replaces what arrives). So a gradient hook on an intermediate tensor (``register_hook``) changes
the gradient once, though a hook with side effects (``retain_grad``, logging) at a frontier node
runs in both passes; and where a group has several frontier nodes and one lies above another, the
lower one is not counted twice (the chain between them is computed and discarded).

The gradients are bit-identical to one backward. Only the parameters receive gradients in the
second pass: a tensor that requires a gradient but is neither a parameter nor a stage input is left
without one (the optimizer steps parameters only).

Not split (one backward, as before; under ``zb_h1`` its ``W`` then does nothing):

- a micro-batch whose forward is recomputed (the recompute would run in both passes);
- a stage whose modules carry backward hooks, or when any module does
  (``register_module_full_backward_hook``): they would run twice;
- a stage run as one ``torch.compile`` graph: its backward is one autograd node that computes the
  input and the weight gradients together, so each pass would run all of it (as
  ``torch.distributed.pipelining`` refuses its zero-bubble schedules under compile). A custom
  ``torch.autograd.Function`` that computes both whatever ``ctx.needs_input_grad`` says runs in
  both passes the same way: its backward twice, correct as long as it only returns its gradients
  (one that adds a weight gradient somewhere itself, such as a fused accumulation into a
  ``main_grad``, would add it twice: keep such a model under one backward with a backward hook on
  the module);
- a graph holding a reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``
  inside a layer), which refuses ``torch.autograd.grad``;
- a graph where a parameter reaches an output without passing a node of the input chain (the
  first stage, whose input needs no gradient; an output computed from the weights alone): the
  first pass would not record the gradient it needs;
- an output that is a leaf (a parameter returned as is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node
from torch.nn.modules import module as _module

__all__ = ["Split", "every_module", "splits"]


def splits(modules: Sequence[nn.Module], recomputed: bool, compiled: bool = False) -> bool:
    """Whether the backward of a micro-batch that ran through ``modules`` (every one, submodules
    included: :func:`every_module`) may be split: its forward is not recomputed, the modules are not
    run as one compiled graph (``compiled``), and no module carries a backward hook (nor is one
    registered for every module)."""
    if recomputed or compiled or _module._global_backward_hooks or _module._global_backward_pre_hooks:
        return False
    return not any(m._backward_hooks or m._backward_pre_hooks for m in modules)


def every_module(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """``layers`` and all their submodules, in order (what :func:`splits` looks at)."""
    return [m for layer in layers for m in layer.modules()]


_REENTRANT = "CheckpointFunctionBackward"  # torch.utils.checkpoint(use_reentrant=True)'s node
_LEAF = "AccumulateGrad"  # a leaf tensor's node (its ``.variable``: the leaf)


class _Group:
    """Parameters that share frontier nodes, and those nodes."""

    __slots__ = ("nodes", "params")

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.params: list[Tensor] = []


class Split:
    """One micro-batch's backward in two passes: :meth:`inputs`, then :meth:`weights`.

    Made by :meth:`of` from the micro-batch's graph before either pass; the first pass records the
    gradients the second needs, and the second frees them (and with them the graph).
    """

    def __init__(self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], groups: list[_Group]) -> None:
        self._outputs, self._inputs, self._groups = list(outputs), list(inputs), groups
        self._recorded: dict[Node, tuple[Tensor | None, ...]] = {}

    @classmethod
    def of(
        cls, outputs: Sequence[Tensor], inputs: Sequence[Tensor], parameters: Sequence[Tensor]
    ) -> Split | None:
        """The split of the backward from ``outputs`` to ``inputs`` and ``parameters``, or ``None``
        where it cannot be split (see the module docstring).

        Args:
            outputs: the tensors the gradients arrive for (each requires a gradient).
            inputs: the stage inputs that receive a gradient (each requires one).
            parameters: the stage's parameters; those that do not require a gradient, or that the
                graph does not reach, are left out.
        """
        if not inputs or any(t.grad_fn is None for t in outputs):
            return None
        roots = {t.grad_fn for t in outputs}
        parents: dict[Node, list[Node]] = {}
        seen: set[Node] = set(roots)  # type: ignore[arg-type]
        leaves: dict[int, Node] = {}  # id of a leaf tensor -> its AccumulateGrad node in this graph
        stack: list[Node] = list(seen)
        while stack:
            node = stack.pop()
            if type(node).__name__ == _REENTRANT:
                return None  # a reentrant checkpoint refuses torch.autograd.grad
            for child, _ in node.next_functions:
                if child is None:
                    continue
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
                    if type(child).__name__ == _LEAF:  # as get_gradient_edge finds it, without its view
                        leaves[id(child.variable)] = child  # type: ignore[attr-defined]
        chain: set[Node] = set()  # nodes from which an input can be reached
        starts = (x.grad_fn if x.grad_fn is not None else leaves.get(id(x)) for x in inputs)
        stack = [n for n in starts if n in seen]
        while stack:
            node = stack.pop()
            if node not in chain:
                chain.add(node)
                stack.extend(parents.get(node, ()))
        groups: dict[Node, _Group] = {}  # frontier node -> its group
        done: set[int] = set()
        for p in parameters:
            if not p.requires_grad or id(p) in done:
                continue
            done.add(id(p))
            start = p.grad_fn if p.grad_fn is not None else leaves.get(id(p))
            if start not in seen:
                continue  # not used by this micro-batch
            frontier: set[Node] = set()
            visited, stack = {start}, [start]
            while stack:
                node = stack.pop()
                if node in roots:
                    return None  # the gradient it needs arrives from an output, not the input chain
                for parent in parents.get(node, ()):
                    if parent in chain:
                        frontier.add(parent)
                    elif parent not in visited:
                        visited.add(parent)
                        stack.append(parent)
            merged = {id(g): g for g in (groups.get(n) for n in frontier) if g is not None}
            group = _Group()
            for other in merged.values():
                group.nodes |= other.nodes
                group.params += other.params
            group.nodes |= frontier
            group.params.append(p)
            for node in group.nodes:
                groups[node] = group
        return cls(outputs, inputs, list({id(g): g for g in groups.values()}.values()))

    def inputs(self, grads: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        """First pass: the gradients of the inputs for the outputs' ``grads`` (``None`` where an
        input does not reach an output), recording what :meth:`weights` needs; the graph is kept."""
        recorded = self._recorded

        def record(node: Node) -> Any:
            def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
                recorded[node] = grad_outputs

            return hook

        handles = [node.register_prehook(record(node)) for g in self._groups for node in g.nodes]
        try:
            found = torch.autograd.grad(
                self._outputs, self._inputs, grads, retain_graph=True, allow_unused=True
            )
        finally:
            for handle in handles:
                handle.remove()
        self._outputs = self._inputs = []
        return found

    def weights(self) -> None:
        """Second pass: accumulate the parameters' gradients into their ``.grad``, as a single
        backward would; frees what the first pass recorded."""
        recorded, self._recorded = self._recorded, {}
        groups, self._groups = self._groups, []
        for group in groups:
            edges, grads = [], []
            for node in group.nodes:
                for k, g in enumerate(recorded.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
            if not edges:
                continue  # no gradient reached these parameters
            # every frontier node takes the gradient the first pass recorded there: a lower one not
            # the chain's again, and none the tensor hooks' (``register_hook``) a second time
            pins = [
                n.register_prehook(lambda _, saved=recorded[n]: saved) for n in group.nodes if n in recorded
            ]
            try:
                torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=True)
            finally:
                for handle in pins:
                    handle.remove()
