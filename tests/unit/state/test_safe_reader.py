"""No file of a checkpoint runs code when read: each of the four kinds of file a checkpoint is made of
(a full file, ``lightning_meta.pt``, ``.metadata``, a non-tensor entry of a shard) with a pickled payload
is refused naming the file, and the payload never runs; with ``weights_only=False`` it is read."""

import pytest
import torch

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.errors import UnsafeCheckpointError
from lightning_gpipe.state.sharded import SHARDED_KEY, load_sharded, save_sharded
from tests.planted import PLANTS, module_and_optimizer


def _strategy(**kwargs):
    """A strategy holding a module and its optimizer, as at ``fit(ckpt_path=...)`` on one device."""
    strategy = GPipeStrategy(**kwargs)
    module, optimizer = module_and_optimizer()
    strategy.connect(module)
    strategy.optimizers = [optimizer]
    return strategy


@pytest.mark.parametrize("plant", PLANTS)
def test_a_payload_in_any_file_is_refused_naming_it_and_never_runs(tmp_path, plant):
    marker = tmp_path / "marker"
    path, culprit = plant(tmp_path, marker)
    strategy = _strategy()
    with pytest.raises(UnsafeCheckpointError) as info:
        strategy.load_checkpoint(path)
    message = str(info.value)
    assert str(culprit) in message and "weights_only=False" in message, message
    assert not marker.exists()
    # the explicit opt-in reads it (and so runs its code, as full pickle does)
    strategy = _strategy(weights_only=False)
    with pytest.raises(Exception):  # noqa: B017 - whatever the payload leaves behind is not a checkpoint
        strategy.load_checkpoint(path)
        raise RuntimeError("loaded")
    assert marker.read_text() == "ran"


def test_an_untouched_sharded_checkpoint_reads_back_its_values(tmp_path):
    """The allow-list covers everything ``torch.distributed.checkpoint`` writes: tensors, the
    optimizer's hyper-parameters and ``lightning_meta.pt`` come back equal."""
    module, optimizer = module_and_optimizer()
    module(torch.randn(4, module.layers[0].in_features)).sum().backward()
    optimizer.step()
    save_sharded({"global_step": 3}, tmp_path / "s.ckpt", module, [optimizer])
    fresh, fresh_optimizer = module_and_optimizer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = load_sharded(tmp_path / "s.ckpt", fresh, [fresh_optimizer])
    assert loaded["global_step"] == 3 and loaded[SHARDED_KEY] is True
    for key, value in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    lrs = [v for k, v in loaded["optimizer_states"][0].items() if k.endswith(".lr")]
    assert lrs and all(lr == optimizer.param_groups[0]["lr"] for lr in lrs)
