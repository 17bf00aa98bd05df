"""The README's example is ``examples/quickstart.py``, byte for byte, and it trains (2 CPU processes)."""

import re

import pytest

from tests._harness import ROOT, check, run_script

QUICKSTART = "examples/quickstart.py"
LOSS_LINE = re.compile(r"^mse on the training data: (\d+\.\d+) before fit, (\d+\.\d+) after$", re.M)


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_bytes().decode()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_shows_the_quickstart_file_byte_for_byte():
    blocks = readme_python_blocks()
    assert len(blocks) == 1, f"the README holds {len(blocks)} python blocks; it shows one, {QUICKSTART}"
    assert blocks[0].encode() == (ROOT / QUICKSTART).read_bytes(), (
        f"the README's block differs from {QUICKSTART}"
    )


@pytest.mark.timeout(180)
def test_quickstart_trains_over_two_stages_and_prints_the_loss():
    """``python examples/quickstart.py``: 80 steps over 2 stages; rank 0 prints the loss before and after."""
    out = check(run_script(QUICKSTART, timeout=150))
    lines = LOSS_LINE.findall(out)
    assert len(lines) == 1, f"expected one loss line, from rank 0 only:\n{out[-4000:]}"
    before, after = map(float, lines[0])
    assert before > 0.5, before  # the untrained model
    assert after < 0.12 and after < before / 5, (before, after)
