"""Layer-by-layer profiling of an ``nn.Sequential``: time, memory and parameters per layer.

The idea is torchgpipe's ``balance_by_time`` / ``balance_by_size`` profilers: run the model
one layer at a time on a sample, so that each layer's cost can be measured on its own, and
hand the per-layer costs to the partition algorithm.

Layers are called like ``nn.Sequential`` calls them: each layer receives the previous
layer's output as its single argument (a tensor, or a tuple of tensors). Between layers the
tensors are detached, so one layer's backward can be timed and its saved activations
measured without the others; a tensor that required grad keeps ``requires_grad`` after
detaching, so each layer sees the same autograd situation as in training (the first layer's
input does not require grad, as in a pipeline's first stage).

Profiling leaves the module as it found it: parameter values, buffers (BatchNorm running
statistics and ``num_batches_tracked``), the device of parameters and buffers, and each
submodule's training flag are restored, and gradients are computed with
``torch.autograd.grad`` so no ``.grad`` is touched.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_gpipe._compat import children, own_buffers, own_parameters
from lightning_gpipe.errors import LayerProfilingError

__all__ = [
    "LayerProfile",
    "LayerProfilingError",
    "layer_parameters",
    "profile_layers",
    "profile_sizes",
    "profile_times",
]

Sample = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any]


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer.

    Attributes:
        index (int): position of the layer in the ``nn.Sequential``.
        name (str): the layer's name in the ``nn.Sequential`` (``"0"``, ``"1"``, ... unless
            named).
        layer_class (str): the layer's class name.
        forward_time (float): forward time in seconds (median over repetitions; 0 if not
            timed).
        backward_time (float): backward time in seconds (median; 0 if the output needs no
            gradient).
        parameters (int): number of parameter elements.
        parameter_bytes (int): bytes of the layer's parameters.
        activation_bytes (int): bytes of the distinct tensors (not parameters) that the
            layer's autograd graph saves for backward on the sample, its input included.
    """

    index: int
    name: str
    layer_class: str
    forward_time: float
    backward_time: float
    parameters: int
    parameter_bytes: int
    activation_bytes: int

    @property
    def time(self) -> float:
        """Forward plus backward time, in seconds."""
        return self.forward_time + self.backward_time

    def memory(self, optimizer_factor: float) -> float:
        """Bytes the layer needs in training: ``activation_bytes + parameter_bytes × (1 +
        optimizer_factor)``, where the factor counts gradients and optimizer state per
        parameter byte."""
        return self.activation_bytes + self.parameter_bytes * (1.0 + optimizer_factor)


def layer_parameters(module: nn.Sequential) -> list[int]:
    """Number of parameter elements of each layer of ``module``.

    Args:
        module (nn.Sequential): the model.

    Returns:
        list[int]: one count per layer (a parameter shared by two layers counts in both).
    """
    return [sum(p.numel() for p in layer.parameters()) for layer in module]


# ---------------------------------------------------------------------------------------
# helpers: samples, state snapshot


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a layer input/output: the tensor itself, or those in a tuple, list or dict
    (nested: a causal LM's layers pass ``{"hidden_states": ..., "position_embeddings": (cos, sin)}``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _detach(value: Any, keep_grad: bool = True) -> Any:
    """Detaches the tensors of ``value``; those that required grad keep requiring it."""

    def one(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        out = v.detach()
        if keep_grad and v.requires_grad:
            out.requires_grad_(True)
        return out

    return _map(one, value)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """Applies ``fn`` to ``value``, or to each leaf of its tuples, lists (named tuples too) and dicts."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, Mapping):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _to_device(value: Any, device: torch.device) -> Any:
    return _map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _sample_device(sample: Sample) -> torch.device:
    tensors = _tensors(sample)
    if not tensors:
        raise TypeError(f"sample must be a tensor or a tuple of tensors (got {type(sample).__name__})")
    return tensors[0].device


@contextlib.contextmanager
def _preserved(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Moves ``module`` to ``device`` in training mode; afterwards restores its parameters,
    buffers (objects, values, devices) and every submodule's training flag."""
    modes = [(m, m.training) for m in module.modules()]
    params = []
    buffers = []
    for m in module.modules():
        for name, p in own_parameters(m).items():
            if p is not None:
                params.append((m, name, p, p.data, p.detach().clone()))
        for name, b in own_buffers(m).items():
            if b is not None:
                buffers.append((m, name, b, b.detach().clone()))
    try:
        with torch.no_grad():
            module.to(device)
        module.train()
        yield
    finally:
        with torch.no_grad():
            for m, name, p, data, value in params:
                own_parameters(m)[name] = p
                p.data = data
                data.copy_(value)
            for m, name, b, value in buffers:
                own_buffers(m)[name] = b
                b.copy_(value)
        for m, training in modes:
            m.training = training


def _layer_names(module: nn.Sequential) -> list[str]:
    return list(children(module))


def _check_sequential(module: nn.Module) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential (got {type(module).__name__})")
    if len(module) == 0:
        raise ValueError("module must have at least one layer (got an empty nn.Sequential)")
    return module


def _synchronize(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ---------------------------------------------------------------------------------------
# one pass over the layers


def _backward(layer: nn.Module, inputs: Any, outputs: Any) -> bool:
    """Runs the layer's backward with all-ones output gradients; False if nothing to do."""
    targets = [t for t in _tensors(outputs) if t.requires_grad]
    if not targets:
        return False
    wrt = [t for t in _tensors(inputs) if t.requires_grad]
    wrt += [p for p in layer.parameters() if p.requires_grad]
    if not wrt:
        return False
    grads = [torch.ones_like(t) for t in targets]
    torch.autograd.grad(targets, wrt, grads, allow_unused=True)
    return True


def _timed_pass(module: nn.Sequential, sample: Any, device: torch.device) -> list[tuple[float, float]]:
    """One forward+backward pass, layer by layer; (forward, backward) seconds per layer."""
    sync = _synchronize(device)
    names = _layer_names(module)
    times = []
    x = _detach(sample, keep_grad=False)
    for index, layer in enumerate(module):
        what = "forward"
        try:
            sync()
            start = time.perf_counter()
            y = layer(x)
            sync()
            middle = time.perf_counter()
            what = "backward"
            _backward(layer, x, y)
            sync()
            end = time.perf_counter()
        except Exception as exc:
            raise LayerProfilingError(index, names[index], layer, what) from exc
        times.append((middle - start, end - middle))
        x = _detach(y)
    return times


def _memory_pass(module: nn.Sequential, sample: Any) -> list[int]:
    """One forward pass, layer by layer; bytes each layer saves for backward."""
    names = _layer_names(module)
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    sizes = []
    x = _detach(sample, keep_grad=False)
    for index, layer in enumerate(module):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without a plain storage
                ptr, nbytes = id(t), t.numel() * t.element_size()
            if ptr not in param_storages:
                seen[ptr] = max(seen.get(ptr, 0), nbytes)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
        except Exception as exc:
            raise LayerProfilingError(index, names[index], layer, "forward (memory)") from exc
        sizes.append(sum(seen.values()))
        x = _detach(y)
        del y
    return sizes


# ---------------------------------------------------------------------------------------
# public profilers


def profile_layers(
    module: nn.Sequential,
    sample: Sample,
    *,
    timeout: float = 1.0,
    warmup: int = 1,
    min_repeats: int = 3,
    device: torch.device | str | None = None,
    measure_time: bool = True,
) -> list[LayerProfile]:
    """Profiles every layer of ``module`` on ``sample``: time, saved activations, parameters.

    After ``warmup`` unmeasured passes, full layer-by-layer forward+backward passes are
    repeated until ``timeout`` seconds have passed (at least ``min_repeats`` passes), and
    each layer's forward and backward times are the medians over the passes. CUDA is
    synchronized around every measurement. Saved activations are measured in one extra
    forward pass with ``torch.autograd.graph.saved_tensors_hooks``.

    Args:
        module (nn.Sequential): the model to profile; it is restored afterwards (see the
            module docstring).
        sample: one input batch: a tensor ``(N, *)`` or a tuple of tensors, batch along
            dim 0. Use the batch size a stage will see (a micro-batch for time; for memory
            see ``balance_by_memory``).
        timeout (float): seconds to spend on measured passes (default: 1.0).
        warmup (int): unmeasured passes first (default: 1).
        min_repeats (int): least number of measured passes (default: 3).
        device: where to profile (default: the sample's device). Module and sample are
            moved there for the duration of profiling.
        measure_time (bool): if False, skip timing (times are 0) (default: True).

    Returns:
        list[LayerProfile]: one entry per layer, in order.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``sample`` holds no tensor.
        ValueError: an empty ``module``, ``timeout < 0``, ``warmup < 0`` or
            ``min_repeats < 1``.
        LayerProfilingError: a layer raised; the message names its index, name and class,
            and the original exception is chained as ``__cause__``.
    """
    module = _check_sequential(module)
    if timeout < 0:
        raise ValueError(f"timeout must be non-negative seconds (got {timeout})")
    if warmup < 0:
        raise ValueError(f"warmup must be non-negative (got {warmup})")
    if min_repeats < 1:
        raise ValueError(f"min_repeats must be at least 1 (got {min_repeats})")
    target = torch.device(device) if device is not None else _sample_device(sample)
    sample = _to_device(sample, target)

    with _preserved(module, target):
        forward = [0.0] * len(module)
        backward = [0.0] * len(module)
        if measure_time:
            for _ in range(warmup):
                _timed_pass(module, sample, target)
            passes: list[list[tuple[float, float]]] = []
            deadline = time.perf_counter() + timeout
            while len(passes) < min_repeats or time.perf_counter() < deadline:
                passes.append(_timed_pass(module, sample, target))
            forward = [statistics.median(p[i][0] for p in passes) for i in range(len(module))]
            backward = [statistics.median(p[i][1] for p in passes) for i in range(len(module))]
        activations = _memory_pass(module, sample)

    names = _layer_names(module)
    return [
        LayerProfile(
            index=i,
            name=names[i],
            layer_class=type(layer).__name__,
            forward_time=forward[i],
            backward_time=backward[i],
            parameters=sum(p.numel() for p in layer.parameters()),
            parameter_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            activation_bytes=activations[i],
        )
        for i, layer in enumerate(module)
    ]


def profile_times(
    module: nn.Sequential,
    sample: Sample,
    *,
    timeout: float = 1.0,
    warmup: int = 1,
    min_repeats: int = 3,
    device: torch.device | str | None = None,
) -> list[float]:
    """Forward+backward seconds of each layer of ``module`` on ``sample`` (medians).

    See ``profile_layers`` for arguments and errors.

    Returns:
        list[float]: seconds per layer, shape ``(L,)``.
    """
    profiles = profile_layers(
        module, sample, timeout=timeout, warmup=warmup, min_repeats=min_repeats, device=device
    )
    return [p.time for p in profiles]


def profile_sizes(
    module: nn.Sequential,
    sample: Sample,
    *,
    optimizer_factor: float = 3.0,
    device: torch.device | str | None = None,
) -> list[float]:
    """Training memory of each layer of ``module`` on ``sample``, in bytes.

    ``activation_bytes + parameter_bytes × (1 + optimizer_factor)`` per layer; see
    ``LayerProfile``.

    Args:
        module (nn.Sequential): the model.
        sample: a tensor ``(N, *)`` or tuple of tensors.
        optimizer_factor (float): bytes of gradients and optimizer state per parameter byte:
            1 for SGD (gradients), 2 for SGD with momentum, 3 for Adam/AdamW (default: 3.0).
        device: where to profile (default: the sample's device).

    Returns:
        list[float]: bytes per layer, shape ``(L,)``.

    Raises:
        ValueError: ``optimizer_factor`` is negative (and see ``profile_layers``).
        LayerProfilingError: a layer raised (see ``profile_layers``).
    """
    if not optimizer_factor >= 0:
        raise ValueError(f"optimizer_factor must be non-negative (got {optimizer_factor})")
    profiles = profile_layers(module, sample, device=device, measure_time=False)
    return [p.memory(optimizer_factor) for p in profiles]
