"""What a plan's root calls in place of its forward while pipelined: the stage, after one check."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import children
from lightning_gpipe.errors import PipelineUsageError
from lightning_gpipe.partition.plan_chain import PlanChain
from lightning_gpipe.partition.probe import Probe

__all__ = ["PlanForward", "chain_input", "check_forward"]


class PlanForward:
    """``root(*args, **kwargs)`` while the plan's stage is installed: the call's chain input to the stage.

    A list plan's chain takes the forward's first argument (the call's one tensor or pytree); a dict
    plan's takes the forward's arguments its parts name (:attr:`.PlanChain.entry`), as a dict, and the
    stage's result is the last part's outputs (one tensor, or a tuple in the plan's order). The first
    call checks the forward against the chain (:func:`check_forward`) on every rank.

    Args:
        chain: the plan's chain (installed).
        stage: this rank's stage.
    """

    def __init__(self, chain: PlanChain, stage: nn.Module) -> None:
        self.chain, self.stage, self.checked = chain, stage, False
        self.signature = inspect.signature(type(chain.root).forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.checked:
            check_forward(self.chain, args, kwargs)
            self.checked = True
        chain = self.chain
        out = self.stage(chain_input(chain, args, kwargs, self.signature))
        if chain.entry is None:
            return out
        result = chain.result or []
        return out[result[0]] if len(result) == 1 else tuple(out[n] for n in result)


def chain_input(
    chain: PlanChain, args: tuple, kwargs: dict, signature: inspect.Signature | None = None
) -> Any:
    """What the chain's first layer takes from a call ``root(*args, **kwargs)``: a list plan's, the
    forward's first argument; a dict plan's, the forward's arguments its parts name, as a dict in the
    order the parts take them (``signature``: the root's ``forward``'s, else read here)."""
    signature = signature or inspect.signature(type(chain.root).forward)
    arguments = _arguments(signature, chain.root, args, kwargs)
    if chain.entry is None:
        return next(iter(arguments.values()))
    return {n: arguments[n] for n in chain.entry}


def _arguments(signature: inspect.Signature, root: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward's arguments by name (keyword ones of ``**kwargs`` among them), without ``self``."""
    bound = signature.bind(root, *args, **kwargs)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for k, (name, value) in enumerate(bound.arguments.items()):
        kind = signature.parameters[name].kind
        if k == 0:
            continue
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def check_forward(chain: PlanChain, args: tuple, kwargs: dict) -> None:
    """Run the root's own ``forward`` on the call's arguments with a stand-in (:class:`Probe`) for each
    part, in training and in evaluation mode, and refuse it unless it calls every layer of the chain
    once, in order, each on what the chain gives it (the previous part's output, or for a dict plan the
    named tensors), and returns the last part's output. The parts compute nothing; the stand-ins'
    values are zeros on the CPU, and the random generators end as they were.

    Raises:
        PipelineUsageError: the forward is not the chain; the message says where it departs and what
            to change.
    """
    root = chain.root
    arguments = _arguments(inspect.signature(type(root).forward), root, args, kwargs)
    modes = [(m, m.training) for m in root.modules()]
    try:
        for training in (True, False):
            calls, returned, outside = _on_stand_ins(chain, args, kwargs, training)
            described = "training" if training else "evaluation"
            _check_calls(chain, calls, returned, arguments, described, outside)
    finally:
        for module, mode in modes:
            module.training = mode


def _on_stand_ins(chain: PlanChain, args: tuple, kwargs: dict, training: bool) -> tuple[list, Any, list[str]]:
    """The forward's calls of the parts' stand-ins, what it returned, and the root's submodules outside
    the plan that it called, in ``training`` mode."""
    root = chain.root
    calls: list[tuple[str, tuple, dict, Any]] = []
    probes: dict[str, Any] = {}
    for name, _, outputs in chain.steps:
        count = len(outputs) if outputs is not None else 1
        part = (chain.original or {})[name]
        floating = [p.dtype for p in part.parameters() if p.is_floating_point()]
        dtype = floating[0] if floating else torch.get_default_dtype()
        if isinstance(part, nn.ModuleList):
            probes[name] = nn.ModuleList(Probe(f"{name}.{k}", count, calls, dtype) for k in range(len(part)))
        elif isinstance(part, nn.ModuleDict):
            probes[name] = nn.ModuleDict({k: Probe(f"{name}.{k}", count, calls, dtype) for k in part})
        else:
            probes[name] = Probe(name, count, calls, dtype)
    staged = dict(children(root))
    held = children(root)
    held.clear()
    held.update((k, probes.get(k, v)) for k, v in (chain.original or {}).items())
    root.train(training)
    outside: list[str] = []  # the submodules outside plan= that the forward calls
    watched = [
        module.register_forward_pre_hook(lambda *_, name=name: outside.append(name))
        for name, module in (chain.original or {}).items()
        if name not in probes and isinstance(module, nn.Module)
    ]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            returned = type(root).forward(root, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure of the forward on stand-ins refuses it
        mode = "training" if training else "evaluation"
        _refuse(
            chain,
            f"run with stand-ins for the parts in {mode} mode, it raised {type(err).__name__}: {err}",
            outside,
        )
    finally:
        for handle in watched:
            handle.remove()
        held.clear()
        held.update(staged)
    return calls, returned, outside


def _check_calls(
    chain: PlanChain, calls: list, returned: Any, arguments: dict[str, Any], mode: str, outside: list[str]
) -> None:
    """Refuse unless ``calls`` (the stand-ins' record) and ``returned`` are the chain's; ``outside``: the
    root's submodules outside the plan that the forward called (named in the refusal)."""
    expected = list(chain.layer_parts)
    called = [name for name, _, _, _ in calls]
    if called != expected:
        _refuse(chain, f"in {mode} mode it calls {called or 'no part'}, the chain is {expected}", outside)
    env = dict(arguments) if chain.entry is not None else {}
    previous: Any = None
    for k, (name, a, kw, out) in enumerate(calls):
        if chain.entry is None:
            given = list(a) + list(kw.values())
            sources = [previous] if k else list(arguments.values())
            what = f"the output of {calls[k - 1][0]!r}" if k else "one of the forward's arguments"
            if not (len(given) == 1 and any(given[0] is v for v in sources)):
                _refuse(
                    chain,
                    f"in {mode} mode {name!r} is called with something other than {what} alone",
                    outside,
                )
            previous = out
        else:
            inputs = chain.calls[name].inputs
            given = list(a) + [kw[n] for n in inputs[len(a) :] if n in kw]
            if len(given) != len(inputs) or any(g is not env.get(n) for g, n in zip(given, inputs)):
                _refuse(chain, f"{name!r} is not called with {inputs} (positionally, in that order)", outside)
            outs = chain.calls[name].outputs
            env.update(zip(outs, (out,) if len(outs) == 1 else out))
    if chain.entry is None:
        if returned is not previous:
            _refuse(
                chain, f"in {mode} mode it returns something other than the output of {called[-1]!r}", outside
            )
        return
    result = chain.result or []
    wanted = env[result[0]] if len(result) == 1 else tuple(env[n] for n in result)
    same = returned is wanted or (
        isinstance(returned, tuple) and isinstance(wanted, tuple) and len(returned) == len(wanted)
        and all(r is w for r, w in zip(returned, wanted))
    )  # fmt: skip
    if not same:
        _refuse(chain, f"it returns something other than {result}", outside)


def _refuse(chain: PlanChain, detail: str, outside: list[str]) -> None:
    """Raise the refusal with ``detail``; ``outside``: the root's submodules outside plan= that the forward
    calls (an activation between two parts, say), named as parts to add. Those it never calls (a
    torchmetrics metric, a loss module) are not named."""
    cls = type(chain.root).__name__
    others = list(dict.fromkeys(outside))
    hint = (
        f" ({cls}.forward calls submodules outside plan=: {', '.join(others)}; name them in plan= in order)"
    )
    raise PipelineUsageError(
        f"{cls}.forward is not the chain that plan= names ({chain.described}): {detail}"
        f"{hint if others else ''}. Under plan= the stages run the parts in that order, each on the previous "
        "part's output (x = self.embed(x); for block in self.blocks: x = block(x); ...; return x), and "
        "nothing else; move other computation into a part (e.g. one module that adds the position "
        "embedding to the token embedding) or into training_step (the loss), and call the model with its "
        "input only. docs/models.md shows the conversion"
    )
