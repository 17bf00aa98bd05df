"""Every public exception of the package, in one place.

Each names what failed and, where one exists, the fix; the modules that raise them import them
from here.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "check_choice",
    "check_count",
    "check_flag",
    "listed",
    "CheckpointError",
    "CollectiveTimeout",
    "LayerProfilingError",
    "MicroBatchError",
    "PartitionError",
    "PipelineUsageError",
    "RankFailed",
    "RankLost",
    "SkipError",
    "StageError",
    "UnsafeCheckpointError",
]


class PartitionError(ValueError):
    """The module cannot be cut into the requested stages."""


class MicroBatchError(TypeError):
    """A value between layers cannot be split, carried or joined (its leaves, its batch size)."""


class SkipError(ValueError):
    """Stash/Pop layers do not pair up (a name stashed twice, popped before stashed, never popped)."""


class PipelineUsageError(RuntimeError):
    """The pipelined module was used in a way the pipeline cannot run (e.g. called twice in a step)."""


class StageError(RuntimeError):
    """A layer of a stage raised; the message names the stage, its layers and the input's shapes."""


class CheckpointError(ValueError):
    """A checkpoint does not fit the module or optimizer it is loaded into."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects that torch's safe unpickler (``weights_only=True``) refuses."""


class CollectiveTimeout(RuntimeError):
    """An operation that needs every rank was not reached by some of them in time."""


class RankLost(RuntimeError):
    """A rank of the job died or lost its connection (killed with SIGKILL, out of memory, a lost node)
    while this one waited for it; the message names it."""


class RankFailed(RuntimeError):
    """Another rank of the job failed with an error of its own (in a step, a hook, a callback, a
    dataloader) while this one waited for it; the message names the rank and its error."""


class LayerProfilingError(RuntimeError):
    """A layer failed while being profiled; the message names the layer, ``__cause__`` holds
    the original exception."""

    def __init__(self, index: int, name: str, layer: nn.Module, what: str) -> None:
        self.index = index
        self.name = name
        self.layer_class = type(layer).__name__
        super().__init__(f"profiling layer {index} ('{name}', {self.layer_class}) failed during {what}")


def check_count(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1: the one check of every count (stages, chunks,
    virtual stages, layers, a batch size), with one message.

    Raises:
        TypeError: ``value`` is not an ``int`` (a ``bool`` included).
        ValueError: ``value`` is below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= 1 ({name}: {value!r})")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({name}: {value!r})")
    return value


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (a switch such as ``deferred_batch_norm``): a string
    such as ``"False"`` from a config would otherwise turn the switch on.

    Raises:
        ValueError: any other value, named.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False ({name}: {value!r})")
    return value


def check_choice(name: str, value: object, choices: dict[str, str]) -> str:
    """Return ``value`` if it is one of ``choices`` (a string argument such as ``batch_norm``), whose
    values say what each choice does, for the message.

    Raises:
        ValueError: any other value, named, with every choice and what it does.
    """
    if not isinstance(value, str) or value not in choices:
        listed_choices = " or ".join(f"{choice!r} ({what})" for choice, what in choices.items())
        raise ValueError(f"{name}={value!r} is not one of {listed_choices}")
    return value


def listed(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``names`` for an error message, joined by commas, with ``", ..."`` after them
    when there are more."""
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
