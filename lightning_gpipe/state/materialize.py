"""Stage-only materialization: a model built on the meta device gets real tensors only for this rank's stage.

With ``Trainer.init_module(empty_init=True)`` or inside ``LightningModule.configure_model`` (see
:meth:`GPipeStrategy.tensor_init_context <lightning_gpipe.GPipeStrategy.tensor_init_context>`)
the layers are built on the meta device: shapes and dtypes, no memory. The strategy cuts the
meta ``nn.Sequential`` into stages first and then materializes only this rank's layers, so a
rank never holds more than its stage.

Initialization is reproducible and independent of the stage count. Layer ``k`` of the
Sequential is initialized on the CPU with its own random stream, seeded by
:func:`layer_seed` ``(seed, k)`` where ``seed`` is the global seed (``seed_everything``); the
caller's random state is left as it was. Every submodule holding tensors of its own is
initialized by its ``reset_parameters()``, as Lightning's FSDP and model-parallel strategies do
(a submodule without one raises ``TypeError``), or, where the layer carries an
``initialize_module(module)`` callable (:data:`INITIALIZER`), by that callable for each such submodule:
the layers of :func:`lightning_gpipe.integrations.transformers.causal_lm` carry the model's own
``_init_weights`` (issue 39). The same layer therefore gets the same values with K = 1, 2 or 3
stages, on any device.

Relation to the plain module's initialization: layer ``k`` equals building that layer eagerly
right after ``torch.manual_seed(layer_seed(seed, k))`` whenever its submodules initialize
themselves in their constructors through ``reset_parameters()`` in registration order (true of
``torch.nn``'s ``Linear``, ``Embedding``, ``Conv*d``, ``LayerNorm``, ``BatchNorm*d``). The plain
module built in one go draws every layer from one stream: the same distributions, other numbers.
An initialization done outside ``reset_parameters`` (e.g. ``module.apply(init_fn)`` after
construction) does not run here; give the layer a ``reset_parameters`` that does it.
:func:`initialize` gives a plain (eager) Sequential exactly the stage-independent values.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe import _lightning
from lightning_gpipe._compat import children
from lightning_gpipe.errors import listed
from lightning_gpipe.partition.cut import cut, key_prefix
from lightning_gpipe.state.loading import CHECKPOINT_SOURCE, LazyCheckpoint, copy_into
from lightning_gpipe.transport.layout import layer_stages


@contextlib.contextmanager
def tensor_init_context(
    default: Callable[..., contextlib.AbstractContextManager[Any]],
    precision_plugin: Any,
    empty_init: bool | None,
) -> Generator[None, None, None]:
    """Where ``Trainer.init_module`` and ``configure_model`` create tensors
    (``GPipeStrategy.tensor_init_context``).

    ``empty_init=True``, and ``None`` inside ``configure_model`` (which runs on every rank once the
    processes are up): on the meta device; at setup the strategy cuts the meta Sequential and
    materializes only this rank's stage (:func:`materialize_stage`: each layer initialized by its
    ``reset_parameters()`` from a stream seeded by the global seed and the layer's index, the same
    for any stage count). Otherwise (``False``, or ``None`` before the processes start), Lightning's
    default (``default``, the strategy's inherited ``tensor_init_context``): on this rank's device.
    The precision plugin's dtype applies either way.
    """
    meta = empty_init is True or (empty_init is None and _lightning.distributed_is_initialized())
    if not meta:
        with default(empty_init=empty_init):
            yield
        return
    with torch.device("meta"), precision_plugin.tensor_init_context():
        yield


# The attribute of a layer that initializes its submodules one by one (in place of their reset_parameters()).
INITIALIZER = "initialize_module"


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index``'s random stream: a hash of ``(seed, index)`` in ``[0, 2**63)``."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def global_seed() -> int:
    """The seed of ``seed_everything`` (``PL_GLOBAL_SEED``); unseeded, a draw from a copy of the CPU
    generator.

    The draw leaves the CPU generator as it was; every rank of the job holds the same state (the
    strategy gives them rank 0's), so every rank draws the same seed.
    """
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is not None:
        return int(env)
    generator = torch.Generator()
    generator.set_state(torch.get_rng_state())
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def has_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    tensors = itertools.chain(module.parameters(recurse=recurse), module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


# id of a tensor given values in this call -> (that tensor, kept alive; its replacement)
Shared = dict[int, tuple[Tensor, Tensor]]


def _give_storage(module: nn.Module, shared: Shared, device: torch.device | str = "cpu") -> bool:
    """Give ``module``'s own meta tensors empty storage on ``device``, keeping ties: a tensor that an
    earlier module of the same call already had (a head tied to the embedding) becomes that one's.

    Returns:
        Whether ``module`` holds a tensor not given values earlier in the call (it needs initializing).
    """
    fresh = False
    tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    for table in tables:
        for name, tensor in list(table.items()):
            if tensor is None:
                continue
            if id(tensor) in shared:
                table[name] = shared[id(tensor)][1]
                continue
            fresh = True
            new: Tensor = tensor
            if tensor.is_meta:
                new = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                table[name] = new
            shared[id(tensor)] = (tensor, new)
    return fresh


def initialize_layer(
    layer: nn.Module, seed: int, only_meta: bool = True, shared: Shared | None = None
) -> None:
    """Initialize ``layer`` on the CPU from the random stream ``seed``, keeping the caller's random state.

    Every submodule holding tensors of its own (on the meta device, if ``only_meta``) gets CPU
    storage (if it was meta) and calls its ``reset_parameters()``, in ``modules()`` order; where
    ``layer`` has a callable ``initialize_module`` attribute (:data:`INITIALIZER`), that is called
    with each such submodule instead, after every one of them has storage (a Hugging Face model's
    ``_init_weights``: its norms and rotary tables have no ``reset_parameters``).

    A tensor that several submodules share (a tied head) keeps being one tensor, and is initialized
    once, by the first of them; ``shared`` carries that across the layers of one call.

    Raises:
        TypeError: such a submodule has no ``reset_parameters`` method (and ``layer`` no initializer).
    """
    shared = {} if shared is None else shared
    initializer = getattr(layer, INITIALIZER, None)
    if callable(initializer):
        _initialize_each(layer, seed, only_meta, initializer, shared)
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in layer.modules():
            if not any(True for _ in itertools.chain(module.parameters(False), module.buffers(False))):
                continue
            if only_meta and not has_meta(module, recurse=False):
                continue
            if not callable(getattr(module, "reset_parameters", None)):
                raise TypeError(
                    f"{type(module).__name__} holds parameters or buffers built on the meta device but has "
                    "no reset_parameters() to initialize them; give it one, or build this layer outside "
                    "Trainer.init_module(empty_init=True) / configure_model"
                )
            if _give_storage(module, shared):
                module.reset_parameters()  # type: ignore[operator]


def _initialize_each(
    layer: nn.Module, seed: int, only_meta: bool, initializer: Callable[[nn.Module], None], shared: Shared
) -> None:
    """``initializer(module)`` for each submodule of ``layer`` holding (meta, if ``only_meta``) tensors
    of its own, in ``modules()`` order, from the random stream ``seed``, once all have CPU storage."""
    own = [
        module
        for module in layer.modules()
        if any(True for _ in itertools.chain(module.parameters(False), module.buffers(False)))
        and (not only_meta or has_meta(module, recurse=False))
    ]
    fresh = [module for module in own if _give_storage(module, shared)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in fresh:
            initializer(module)


def materialize_layers(
    layers: Iterable[tuple[int, nn.Module]], seed: int, device: torch.device | str = "cpu"
) -> list[int]:
    """Give the meta tensors of each ``(index, layer)`` real values, then move the layer to ``device``.

    Args:
        layers: ``(index in the Sequential, layer)`` pairs, e.g. one stage's.
        seed: the global seed; layer ``index`` draws from :func:`layer_seed` ``(seed, index)``.
        device: where the layers end up.

    Returns:
        The indices of the layers that had meta tensors.

    Raises:
        TypeError: see :func:`initialize_layer`.
    """
    done: list[int] = []
    shared: Shared = {}  # a tensor tied across these layers stays one tensor, initialized by its first layer
    for index, layer in layers:
        if layer is None or not has_meta(layer):
            continue
        initialize_layer(layer, layer_seed(seed, index), only_meta=True, shared=shared)
        layer.to(device)
        done.append(index)
    return done


def initialize(sequential: nn.Sequential, seed: int) -> nn.Sequential:
    """Initialize every layer of a Sequential (eager or meta) as the stages would: the one-device twin.

    Layer ``k`` gets :func:`layer_seed` ``(seed, k)``'s values, whatever the stage count.
    Meta tensors get CPU storage. Returns ``sequential``.
    """
    shared: Shared = {}
    for index, layer in enumerate(children(sequential).values()):
        if layer is not None:
            initialize_layer(layer, layer_seed(seed, index), only_meta=False, shared=shared)
    return sequential


def load_layers(
    layers: Iterable[tuple[str, nn.Module]],
    prefix: str,
    state: Mapping[str, Tensor],
    read_into: Callable[[Tensor, Tensor], None],
    device: torch.device | str = "cpu",
) -> list[str]:
    """Give the meta tensors of each ``(name, layer)`` the values of a checkpoint's ``state_dict``.

    Every submodule with meta tensors of its own gets empty storage on ``device``; then each of the
    layer's ``state_dict`` entries is filled by
    ``read_into(state[prefix + name + "." + key], entry)`` (e.g.
    :meth:`lightning_gpipe.state.loading.LazyCheckpoint.read_into`), one tensor at a time. Layers
    without meta tensors keep their values.

    Returns:
        The names of the layers loaded.

    Raises:
        lightning_gpipe.checkpoint.CheckpointError: an entry is missing or has another shape.
    """
    done = []
    shared: Shared = {}  # a tensor tied across these layers stays one tensor
    for name, layer in layers:
        if layer is None or not has_meta(layer):
            continue
        for module in layer.modules():
            if has_meta(module, recurse=False):
                _give_storage(module, shared, device)
        copy_into({f"{prefix}{name}.{k}": v for k, v in layer.state_dict().items()}, state, read_into)
        done.append(name)
    return done


def check_stage_only_balance(balance: Any) -> None:
    """Refuse a profiling balancer for a model built on the meta device (each rank holds one stage).

    Raises:
        ValueError: ``balance`` is ``"time"`` or ``"memory"``.
    """
    if balance in ("time", "memory"):
        raise ValueError(
            f"balance={balance!r} profiles the whole model on rank 0, but it was built on the meta device "
            "(Trainer.init_module(empty_init=True) or configure_model) to hold only one stage per rank; "
            "use balance='parameters', 'uniform' or a list of layers per stage"
        )


def materialize_stage(
    model: nn.Module,
    name: str,
    sequential: nn.Sequential,
    balance: list[int],
    stage: int,
    device: torch.device,
    stages: int | None = None,
) -> None:
    """Give stage ``stage``'s meta layers real tensors on ``device``; the other stages' stay meta.

    A module from :func:`lightning_gpipe.load_from_checkpoint` reads them from its checkpoint;
    otherwise each layer is initialized by :func:`materialize_layers` (its ``reset_parameters()``,
    from a random stream of the global seed and the layer's index).
    """
    layers = cut(sequential, balance, stage, stages)
    source = getattr(model, CHECKPOINT_SOURCE, None)
    if source is None:
        where = layer_stages(balance, stages)
        indices = [k for k, s in enumerate(where) if s == stage]  # the layers' indices in the Sequential
        indexed = [(index, layer) for index, (_, layer) in zip(indices, layers)]
        materialize_layers(indexed, global_seed(), device)
        return
    path, weights_only = source
    lazy = LazyCheckpoint(path, weights_only)
    load_layers(layers, key_prefix(name), lazy.data.get("state_dict", {}), lazy.read_into, device)


def check_nothing_meta(model: nn.Module) -> None:
    """Raise if a tensor outside the pipelined Sequential is still on the meta device (after the cut).

    Raises:
        ValueError: naming up to five such tensors.
    """
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        shown = listed(left)
        raise ValueError(
            f"{len(left)} tensors outside the pipelined nn.Sequential are on the meta device ({shown}); only "
            "the Sequential's layers are materialized per stage: create the rest outside "
            "Trainer.init_module(empty_init=True) and configure_model's layers"
        )
