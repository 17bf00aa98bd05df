"""The last stage's loss may reach the pipeline only through the pipelined call's output (issue 40).

On the last stage the pipelined call returns leaves detached from the stage's graph, and the loss
backpropagates into them; the stage's backward carries their gradients on. A loss whose graph
reaches anything else that requires grad (a parameter: an L2 penalty over ``self.parameters()`` or
``self.layers[-1].weight``; an activation inside the stage: an aux loss a layer stored in forward)
would train differently from one device: ``self.parameters()`` there is the last stage's only, and
a stored activation belongs to one micro-batch and would be backpropagated a second time.
:func:`check_loss_graph` walks the loss's autograd graph from its ``grad_fn`` down to the leaves,
stopping at the call's output, and refuses such a loss with the fix. The walk visits only the
loss's own part of the graph (the call's output is a leaf): its nodes, once each.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from lightning_gpipe.errors import PipelineUsageError

__all__ = ["check_loss_graph"]


def check_loss_graph(loss: Tensor, outputs: Iterable[Tensor], module: nn.Module) -> None:
    """Raise if ``loss``'s graph reaches a tensor that requires grad other than ``outputs`` (the leaves the
    pipelined call returned on the last stage).

    ``module``: the LightningModule, to name a parameter the loss reaches.

    Raises:
        PipelineUsageError: naming the parameter (or the stage's activation) reached, and the fixes.
    """
    fn = getattr(loss, "grad_fn", None)
    if fn is None:
        return
    allowed = {id(t) for t in outputs}
    reached: list[Tensor] = []
    seen, todo = {fn}, [fn]
    while todo:
        node = todo.pop()
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in allowed:
            reached.append(variable)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    if reached:
        raise PipelineUsageError(_message(reached, module))


def _message(reached: list[Tensor], module: nn.Module) -> str:
    ids = {id(t) for t in reached}
    names = [n for n, p in module.named_parameters() if id(p) in ids]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" ({len(names)} in all)" if len(names) > 3 else "")
    what = (
        f"the parameter{'s' if len(names) > 1 else ''} {shown}"
        if names
        else "a tensor inside the stage (an activation or an aux loss a layer stored in forward)"
    )
    return (
        f"the loss training_step returned reaches {what} other than through the pipelined call's output. "
        "On the last stage self.parameters() holds the last stage's parameters only, and the other stages "
        "never see this loss, so it would train differently from one device. Fixes: an L2 penalty over "
        "the parameters is the optimizer's weight_decay (SGD and Adam add weight_decay * p to the gradient: "
        "lam * sum(p.pow(2).sum()) is weight_decay=2 * lam); any other term a layer computes (an aux loss, "
        "a penalty over its own weights) goes through `return lightning_gpipe.aux_loss(output, term)` in "
        "the layer's forward, which adds it on the layer's own stage (docs/lightning.md, 'The whole model')"
    )
