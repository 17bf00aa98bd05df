"""How each stage is compiled: ``GPipeStrategy(compile=...)`` or the user's own ``torch.compile``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def check_compile(compile: Any) -> bool | dict[str, Any]:
    """Validate ``GPipeStrategy(compile=...)``: a bool or a dict of ``torch.compile`` arguments.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(compile, (bool, dict)):
        raise ValueError(
            f"compile must be a bool or a dict of torch.compile arguments (compile: {compile!r}); "
            'e.g. compile={"backend": "inductor", "mode": "max-autotune"}'
        )
    return compile


def stage_compiler(
    compile: bool | dict[str, Any], user_compile: Callable[[nn.Module], nn.Module] | None
) -> Callable[[nn.Module], nn.Module] | None:
    """How each stage's layers are compiled: ``compile=`` (``torch.compile`` with those arguments), else
    like the user's compiled Sequential (:func:`.cut.uncompile`), else ``None`` (not compiled)."""
    if compile:
        kwargs = compile if isinstance(compile, dict) else {}
        return lambda module: torch.compile(module, **kwargs)  # type: ignore[return-value]
    return user_compile
