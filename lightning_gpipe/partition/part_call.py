"""How a plan's part that passes several named tensors is applied inside a stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_gpipe.errors import PartitionError

__all__ = ["PartCall"]


class PartCall:
    """Applies one part of a dict plan (``{name: (inputs, outputs)}``, the transformers
    ``_pp_plan`` format) to the tensors that travel between parts, a dict by name.

    The part is called with its inputs positionally, in the order the plan lists them:
    ``outputs = part(env[inputs[0]], env[inputs[1]], ...)``; one output is the returned tensor, several
    a returned tuple of as many. The dict it returns holds the part's outputs, first (the pipeline splits
    by the first tensor's dim 0), then, of what it was given, only the names a later part (or the
    chain's result) still takes (``keep``), so nothing else crosses to the next stage.

    Args:
        name: the part's name in the model (``"blocks.3"``), for errors.
        inputs, outputs: the names the part takes and gives.
        keep: the names still needed after this part.
    """

    def __init__(self, name: str, inputs: Sequence[str], outputs: Sequence[str], keep: Sequence[str]) -> None:
        self.name, self.inputs, self.outputs, self.keep = name, list(inputs), list(outputs), set(keep)

    def __call__(self, layer: nn.Module, env: dict[str, Any]) -> dict[str, Any]:
        """``env`` after ``layer``: its outputs added under their names, what no later part takes dropped.

        Raises:
            PartitionError: the part returned a number of values other than its outputs'.
        """
        out = layer(*[env[n] for n in self.inputs])
        values = (out,) if len(self.outputs) == 1 else out
        if not isinstance(values, (tuple, list)) or len(values) != len(self.outputs):
            raise PartitionError(
                f"part {self.name!r} returned {type(out).__name__} but the plan names {len(self.outputs)} "
                f"outputs ({', '.join(self.outputs)}); return a tuple of that many tensors or fix the plan"
            )
        out_env = dict(zip(self.outputs, values))  # first: the batch size N is the first tensor's dim 0
        out_env.update((k, v) for k, v in env.items() if k in self.keep and k not in out_env)
        return out_env
