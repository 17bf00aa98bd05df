"""strategy="gpipe_notebook" in a real Jupyter kernel (nbclient): forked ranks, trained weights back
in the notebook."""

import nbformat
import pytest
from nbclient import NotebookClient

from tests._harness import ROOT, _env

CELLS = [
    f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport torch\ntorch.set_num_threads(1)",
    "import pytorch_lightning as pl\nimport lightning_gpipe\n"
    "from tests.models import Net, make_data, trainer_kwargs, train_single_device",
    # Lightning's interactive check: this kernel is an interactive session
    "from lightning_fabric.utilities.imports import _IS_INTERACTIVE\nassert _IS_INTERACTIVE",
    "pl.seed_everything(0, verbose=False)\nmodel = Net('mlp')\n"
    "trainer = pl.Trainer(strategy='gpipe_notebook', devices=2, **trainer_kwargs(5))\n"
    "trainer.fit(model, make_data('mlp', 10, 5))",
    "reference = train_single_device('mlp', 0, steps=5)\n"
    "ref = reference.state_dict()\n"
    "diff = max((v - ref[k]).abs().max().item() for k, v in model.state_dict().items())\n"
    "assert diff <= 1e-5, diff\nprint('max parameter difference', diff)",
    # the user's torch.compile wrapper is back in the kernel's model after fit (the ranks are forks)
    "compiled = Net('mlp', compile_layers={'backend': 'eager'})\n"
    "trainer = pl.Trainer(strategy='gpipe_notebook', devices=2, **trainer_kwargs(2))\n"
    "trainer.fit(compiled, make_data('mlp', 10, 2))\n"
    "assert type(compiled.layers).__name__ == 'OptimizedModule', type(compiled.layers)\n"
    "assert all(k.startswith('layers._orig_mod.') for k in compiled.state_dict())",
    # strategy="gpipe" (re-running a script) is refused here with the way out
    "try:\n    pl.Trainer(strategy='gpipe', devices=2, **trainer_kwargs(1))\n"
    "except RuntimeError as err:\n    assert \"strategy='gpipe_notebook'\" in str(err), err\n"
    "else:\n    raise AssertionError('gpipe accepted in a notebook')",
]


@pytest.mark.timeout(300)
def test_gpipe_notebook_trains_two_stages_in_a_jupyter_kernel(tmp_path, monkeypatch):
    """A notebook trains Net("mlp") with Trainer(strategy="gpipe_notebook", devices=2); the weights
    that come back into the kernel equal 5 one-device steps (≤ 1e-5); a compiled Sequential is the
    user's wrapper again after fit."""
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    printed = "".join(o.get("text", "") for o in notebook.cells[4].outputs)
    assert "max parameter difference" in printed
