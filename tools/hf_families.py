"""The table of docs/models.md: every causal-LM family with a pipeline plan in the installed
transformers, and those ``causal_lm`` cuts by a built-in plan, and whether it cuts each exactly or
refuses it (and why).

Run: ``python tools/hf_families.py`` prints the Markdown table; ``--write`` puts it in docs/models.md,
between its ``<!-- families: begin -->`` and ``<!-- families: end -->`` lines (CPU, no download).
Each family is a tiny random model from :func:`~lightning_gpipe.integrations.transformers.shrink_config`
of its default config; ``causal_lm``'s construction-time check decides.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from lightning_gpipe.integrations.transformers import (
    UnsupportedModelError,
    builtin_plan_families,
    causal_lm,
    plan_families,
    shrink_config,
)


def tiny_model(model_type: str, class_name: str) -> torch.nn.Module:
    """A tiny random model of the family (seeded, fp32)."""
    torch.manual_seed(0)
    return getattr(transformers, class_name)(shrink_config(CONFIG_MAPPING[model_type]()))


def status(model_type: str, class_name: str) -> str:
    """``"exact"``, or ``"refused: <why>"``."""
    try:
        model = tiny_model(model_type, class_name)
    except Exception as error:  # noqa: BLE001 - a family whose tiny config cannot be built is reported
        return f"refused: its tiny config cannot be built ({type(error).__name__}: {error})"
    try:
        causal_lm(model)
    except UnsupportedModelError as error:
        return "refused: " + str(error).split(": ", 1)[1].split("; build the nn.Sequential")[0]
    return "exact"


DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"
BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"


def table() -> str:
    """The Markdown table and a line counting the exact families."""
    families, builtin = plan_families(), builtin_plan_families()
    rows, exact, builtin_exact = [], 0, 0
    for model_type, class_name in sorted(families + builtin):
        verdict = status(model_type, class_name)
        if (model_type, class_name) in builtin:
            builtin_exact += verdict == "exact"
            verdict += " (built-in plan: its config has none)"
        else:
            exact += verdict == "exact"
        rows.append(f"| `{model_type}` | `{class_name}` | {verdict.replace('|', '/')} |")
    head = (
        f"transformers {transformers.__version__}: {exact} of {len(families)} families with a plan are "
        f"exact; {builtin_exact} of {len(builtin)} families without one are exact by a built-in plan."
    )
    return "\n".join([head, "", "| family | class | status |", "|---|---|---|", *rows])


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    text = table()
    if "--write" in sys.argv[1:]:
        page = DOCS.read_text()
        before, rest = page.split(BEGIN, 1)
        DOCS.write_text(f"{before}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(text)
    print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
