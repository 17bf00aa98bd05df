"""No file of a checkpoint runs code when read: each of the four kinds of file a checkpoint is made of
(a full file, ``lightning_meta.pt``, ``.metadata``, a non-tensor entry of a shard) with a pickled payload
is refused naming the file, and the payload never runs; with ``weights_only=False`` it is read."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.errors import UnsafeCheckpointError
from lightning_gpipe.state.sharded import _FLAT, META_FILE, SHARDED_KEY, load_sharded, save_sharded
from tests.models import Net


class _Payload:
    """Unpickling this writes a marker file: what a malicious checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _module_and_optimizer():
    module = Net("mlp")
    return module, module.configure_optimizers()


def _sharded(path):
    module, optimizer = _module_and_optimizer()
    save_sharded({"global_step": 3, "loops": {"x": 1}}, path, module, [optimizer])
    return path


def _plant_full(tmp_path, marker):
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": Net("mlp").state_dict(), "hyper_parameters": {"x": _Payload(marker)}}, path)
    return path, path


def _plant_meta(tmp_path, marker):
    path = _sharded(tmp_path / "s.ckpt")
    torch.save({SHARDED_KEY: True, "loops": _Payload(marker)}, path / META_FILE)
    return path, path / META_FILE


def _plant_metadata(tmp_path, marker):
    path = _sharded(tmp_path / "s.ckpt")
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    return path, path / ".metadata"


def _plant_entry(tmp_path, marker):
    """A shard whose entry for the optimizer's learning rate (a non-tensor) is the payload."""
    path = _sharded(tmp_path / "s.ckpt")
    module, optimizer = _module_and_optimizer()
    flat = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    key = next(k for k, v in flat.items() if k.endswith(".lr"))
    flat[key] = _Payload(marker)
    dcp.save({"model": module.state_dict(), "optimizers": [flat]}, checkpoint_id=str(path))
    return path, path / "__0_0.distcp"


def _strategy(**kwargs):
    """A strategy holding a module and its optimizer, as at ``fit(ckpt_path=...)`` on one device."""
    strategy = GPipeStrategy(**kwargs)
    module, optimizer = _module_and_optimizer()
    strategy.connect(module)
    strategy.optimizers = [optimizer]
    return strategy


@pytest.mark.parametrize("plant", [_plant_full, _plant_meta, _plant_metadata, _plant_entry])
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
    module, optimizer = _module_and_optimizer()
    module(torch.randn(4, module.layers[0].in_features)).sum().backward()
    optimizer.step()
    save_sharded({"global_step": 3}, tmp_path / "s.ckpt", module, [optimizer])
    fresh, fresh_optimizer = _module_and_optimizer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = load_sharded(tmp_path / "s.ckpt", fresh, [fresh_optimizer])
    assert loaded["global_step"] == 3 and loaded[SHARDED_KEY] is True
    for key, value in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    lrs = [v for k, v in loaded["optimizer_states"][0].items() if k.endswith(".lr")]
    assert lrs and all(lr == optimizer.param_groups[0]["lr"] for lr in lrs)
