"""Loading is strict and named: a checkpoint that does not fit the model is refused, as on one device,
before anything is read into it, and every unreadable checkpoint is refused naming the file and what
is wrong with it."""

import re

import pytest
import torch

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.errors import CheckpointError
from lightning_gpipe.state.check import check_optimizer_counts
from lightning_gpipe.state.sharded import META_FILE, save_sharded
from tests.models import Net


def _strategy(strict=True):
    strategy = GPipeStrategy()
    module = Net("mlp")
    module.strict_loading = strict
    strategy.connect(module)
    strategy.optimizers = [module.configure_optimizers()]
    return strategy


def test_a_deeper_models_checkpoint_is_refused_naming_the_unexpected_keys(tmp_path):
    state = dict(Net("mlp").state_dict())
    state["layers.6.weight"], state["layers.6.bias"] = torch.zeros(2, 2), torch.zeros(2)
    path = tmp_path / "deeper.ckpt"
    torch.save({"state_dict": state}, path)
    with pytest.raises(CheckpointError) as info:
        _strategy().load_checkpoint(path)
    assert str(path) in str(info.value)
    assert 'Unexpected key(s) in state_dict: "layers.6.weight", "layers.6.bias".' in str(info.value)
    loaded = _strategy(strict=False).load_checkpoint(path)  # strict_loading=False: the keys that fit
    assert set(loaded["state_dict"]) == set(Net("mlp").state_dict())


def test_a_sharded_checkpoint_of_a_deeper_model_is_refused_before_it_is_read(tmp_path):
    deeper = Net("mlp")
    deeper.layers.append(torch.nn.Linear(2, 2))
    path = tmp_path / "deeper"
    save_sharded({"global_step": 1}, path, deeper, [])
    strategy = _strategy()
    before = {k: v.clone() for k, v in strategy.lightning_module.state_dict().items()}
    with pytest.raises(CheckpointError, match=r'Unexpected key\(s\) in state_dict: "layers.5.weight"'):
        strategy.load_checkpoint(path)
    after = strategy.lightning_module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing was read into the model


def test_a_shallower_checkpoint_is_refused_naming_the_missing_keys(tmp_path):
    state = {k: v for k, v in Net("mlp").state_dict().items() if not k.startswith("layers.4.")}
    path = tmp_path / "shallower.ckpt"
    torch.save({"state_dict": state}, path)
    missing = r'Missing key\(s\) in state_dict: "layers.4.weight", "layers.4.bias"'
    with pytest.raises(CheckpointError, match=missing):
        _strategy().load_checkpoint(path)


def test_a_shape_mismatch_is_refused_even_when_not_strict(tmp_path):
    state = dict(Net("mlp").state_dict())
    rows, cols = state["layers.2.weight"].shape
    state["layers.2.weight"] = torch.zeros(rows + 1, cols)
    path = tmp_path / "wide.ckpt"
    torch.save({"state_dict": state}, path)
    message = (
        f"size mismatch for layers.2.weight: copying a param with shape torch.Size([{rows + 1}, {cols}]) "
        f"from checkpoint, the shape in current model is torch.Size([{rows}, {cols}])."
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        _strategy(strict=False).load_checkpoint(path)


def test_a_plain_optimizer_state_of_another_parameter_count_is_refused(tmp_path):
    """A one-device optimizer state (no names, one group) is matched by position: with more parameters
    than the model (a deeper model's) its moments would land on the wrong parameters."""
    names = [n for n, _ in Net("mlp").named_parameters()]
    deeper = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(len(names) + 2))}]}
    holds = rf"c.ckpt: optimizer 0's state holds {len(names) + 2} parameters"
    with pytest.raises(CheckpointError, match=holds):
        check_optimizer_counts([deeper], names, tmp_path / "c.ckpt")
    beyond = {"state": {len(names): {}}, "param_groups": [{"lr": 0.1, "params": list(range(len(names)))}]}
    indices = rf"indices \[{len(names)}\] beyond its {len(names)} parameters"
    with pytest.raises(CheckpointError, match=indices):
        check_optimizer_counts([beyond], names, tmp_path / "c.ckpt")
    check_optimizer_counts([{**deeper, "param_groups": [{"params": list(range(len(names)))}]}], names, "c")


def _full(tmp_path):
    path = tmp_path / "c.ckpt"
    torch.save({"state_dict": Net("mlp").state_dict()}, path)
    return path


def _empty(tmp_path):
    path = _full(tmp_path)
    path.write_bytes(b"")
    return path, path, "is empty (0 bytes)"


def _truncated(tmp_path):
    path = _full(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path, path, "is truncated"


def _not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_text("hello")
    return path, path, "is not a checkpoint"


def _not_lightning(tmp_path):
    path = tmp_path / "t.ckpt"
    torch.save(torch.zeros(2), path)
    return path, path, "is not a Lightning checkpoint"


def _sharded(tmp_path):
    path = tmp_path / "s.ckpt"
    module = Net("mlp")
    save_sharded({"global_step": 1}, path, module, [module.configure_optimizers()])
    return path


def _no_meta(tmp_path):
    path = _sharded(tmp_path)
    (path / META_FILE).unlink()
    return path, path, f"has no {META_FILE}: an interrupted save"


def _empty_directory(tmp_path):
    path = tmp_path / "dir.ckpt"
    path.mkdir()
    return path, path, f"has no {META_FILE}: not a checkpoint directory"


def _truncated_meta(tmp_path):
    path = _sharded(tmp_path)
    meta = path / META_FILE
    meta.write_bytes(meta.read_bytes()[:60])
    return path, meta, "is truncated"


def _truncated_shard(tmp_path):
    path = _sharded(tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return path, shard, "is truncated or damaged"


def _truncated_metadata(tmp_path):
    path = _sharded(tmp_path)
    metadata = path / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    return path, metadata, "is damaged"


@pytest.mark.parametrize(
    "make",
    [_empty, _truncated, _not_a_checkpoint, _not_lightning, _no_meta, _empty_directory, _truncated_meta,
     _truncated_shard, _truncated_metadata],
)  # fmt: skip
def test_an_unreadable_checkpoint_is_refused_naming_the_file_and_the_fault(tmp_path, make):
    path, culprit, fault = make(tmp_path)
    with pytest.raises(CheckpointError) as info:
        _strategy().load_checkpoint(path)
    assert f"{culprit} {fault}" in str(info.value)
