"""A checkpoint checked against the whole model before anything is loaded: keys, shapes, optimizer counts.

Every rank checks the whole model's keys and shapes (not only its stage's) against the whole
checkpoint, so a checkpoint that does not fit is refused on every rank alike, before any rank
loads or trains, with the messages ``nn.Module.load_state_dict`` gives on one device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_gpipe.errors import CheckpointError
from lightning_gpipe.state.optimizer import NAMES_KEY

__all__ = ["Shapes", "check_optimizer_counts", "check_state_fits", "shapes"]

Shapes = Mapping[str, "tuple[int, ...] | None"]  # key -> tensor shape (None: not a tensor)


def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Each entry's shape (``None`` for a non-tensor) of a ``state_dict`` (meta tensors included)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _quoted(keys: Sequence[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)


def check_state_fits(
    saved: Shapes, model: Shapes, strict: bool, source: str | os.PathLike, owner: str
) -> None:
    """Return if the checkpoint's model state (``saved``) fits the whole model's (``model``).

    Args:
        strict: the keys must be equal (as ``load_state_dict(strict=True)``); shapes are always
            checked, for the keys both hold.
        source: the checkpoint, named in the message.
        owner: the model's class name.

    Raises:
        CheckpointError: naming ``source`` and, as torch does, the missing keys, the unexpected
            keys and each size mismatch.
    """
    errors = []
    if strict and (missing := [k for k in model if k not in saved]):
        errors.append(f"Missing key(s) in state_dict: {_quoted(missing)}.")
    if strict and (unexpected := [k for k in saved if k not in model]):
        errors.append(f"Unexpected key(s) in state_dict: {_quoted(unexpected)}.")
    for key, shape in model.items():
        got = saved.get(key)
        if shape is not None and got is not None and tuple(got) != tuple(shape):
            errors.append(
                f"size mismatch for {key}: copying a param with shape {torch.Size(got)} from checkpoint, "
                f"the shape in current model is {torch.Size(shape)}."
            )
    if errors:
        keys = not all(e.startswith("size") for e in errors)
        hint = " (strict_loading=False loads the keys that fit)" if keys else ""
        raise CheckpointError(
            f"{os.fspath(source)} does not fit {owner}{hint}: Error(s) in loading state_dict for {owner}:\n\t"
            + "\n\t".join(errors)
        )


def check_optimizer_counts(
    states: Sequence[Mapping[str, Any]], plain_names: Sequence[str] | None, source: str | os.PathLike
) -> None:
    """Return if each merged optimizer state can be matched to the model's parameters.

    A state with parameter names (:data:`NAMES_KEY`) names each of its parameters once; a plain
    one-device state (one group, no names) is matched by position, as ``Optimizer.load_state_dict``
    matches it, so it must list exactly as many parameters as the model has (``plain_names``).

    Raises:
        CheckpointError: the counts differ, or a state holds an index beyond its parameters (the
            message names ``source``, the optimizer and both counts).
    """
    for i, merged in enumerate(states):
        count = sum(len(g.get("params", ())) for g in merged.get("param_groups", ()))
        names = merged.get(NAMES_KEY)
        if names is not None and len(names) != count:
            raise CheckpointError(
                f"{os.fspath(source)}: optimizer {i}'s state names {len(names)} parameters but its groups "
                f"list {count}: the file is damaged"
            )
        positional = names is None and len(merged.get("param_groups", ())) == 1
        if positional and plain_names is not None and count != len(plain_names):
            raise CheckpointError(
                f"{os.fspath(source)}: optimizer {i}'s state holds {count} parameters, the model has "
                f"{len(plain_names)}; it was saved for another model (loaded by position, moments would "
                "land on the wrong parameters)"
            )
        beyond = [k for k in merged.get("state", {}) if not isinstance(k, int) or not 0 <= k < count]
        if beyond:
            raise CheckpointError(
                f"{os.fspath(source)}: optimizer {i}'s state holds parameter indices {beyond[:5]} beyond its "
                f"{count} parameters"
            )
