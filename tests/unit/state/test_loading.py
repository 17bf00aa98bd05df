"""Checkpoint files are read with torch's safe unpickler unless the user opts out, and stage by stage."""

import pytest
import torch

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.errors import UnsafeCheckpointError
from lightning_gpipe.state.loading import LazyCheckpoint, copy_into, meta_tensors, stage_part
from lightning_gpipe.state.optimizer import CheckpointError
from lightning_gpipe.state.sharded import META_FILE, load_sharded
from tests.models import Net


class _Payload:
    """Unpickling this writes a marker file: what a malicious checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _crafted(path, marker):
    torch.save({"state_dict": Net("mlp").state_dict(), "hyper_parameters": {"x": _Payload(marker)}}, path)
    return path


def _sharded_dir(tmp_path, marker):
    directory = tmp_path / "sharded.ckpt"
    directory.mkdir()
    torch.save({"global_step": 1, "loops": _Payload(marker)}, directory / META_FILE)
    return directory


def test_full_checkpoint_with_code_is_refused_naming_the_file_and_the_opt_in(tmp_path):
    marker = tmp_path / "marker"
    path = _crafted(tmp_path / "evil.ckpt", marker)
    strategy = GPipeStrategy()
    strategy.connect(Net("mlp"))
    with pytest.raises(UnsafeCheckpointError) as info:
        strategy.load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "weights_only=False" in message and "GLOBAL exec" in message
    assert not marker.exists()
    # the explicit opt-in loads it (and so runs its code, as full pickle does)
    strategy = GPipeStrategy(weights_only=False)
    strategy.connect(Net("mlp"))
    strategy.load_checkpoint(path)
    assert marker.read_text() == "ran"


def test_sharded_metadata_with_code_is_refused_naming_the_file_and_the_opt_in(tmp_path):
    marker = tmp_path / "marker"
    directory = _sharded_dir(tmp_path, marker)
    strategy = GPipeStrategy()
    strategy.connect(Net("mlp"))
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False") as info:
        strategy.load_checkpoint(directory)
    assert str(directory / META_FILE) in str(info.value)
    with pytest.raises(UnsafeCheckpointError):
        load_sharded(directory, Net("mlp"), [])
    assert not marker.exists()


def test_strategy_weights_only_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match=r"weights_only must be None, True or False \(weights_only: 'no'\)"):
        GPipeStrategy(weights_only="no")


def test_lazy_checkpoint_reads_only_the_tensors_asked_for(tmp_path):
    """Structure first (meta tensors, nothing read), then each tensor from its offset: views and
    dtypes kept."""
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    saved = {
        "state_dict": {"a": base, "view": base[1:, 2:5], "half": torch.randn(3, dtype=torch.bfloat16)},
        "loops": {"step": torch.tensor(7), "name": "x"},
    }
    torch.save(saved, tmp_path / "c.ckpt")
    lazy = LazyCheckpoint(tmp_path / "c.ckpt")
    assert all(t.is_meta for t in meta_tensors(lazy.data)) and len(list(meta_tensors(lazy.data))) == 4
    for key, tensor in saved["state_dict"].items():
        read = lazy.read(lazy.data["state_dict"][key])
        assert read.dtype == tensor.dtype and torch.equal(read, tensor)
    assert lazy.materialize(lazy.data["loops"]) == {"step": torch.tensor(7), "name": "x"}
    target = {"view": torch.zeros(3, 3)}
    copy_into(target, lazy.data["state_dict"], lazy.read_into)
    assert torch.equal(target["view"], base[1:, 2:5])
    with pytest.raises(CheckpointError, match="lacks 1 tensors of this stage: missing"):
        copy_into({"missing": torch.zeros(1)}, lazy.data["state_dict"], lazy.read_into)


@pytest.mark.parametrize("module", [None, "net"])
def test_stage_part_of_a_weights_only_file_has_no_optimizer_states(tmp_path, module):
    """``ModelCheckpoint(save_weights_only=True)`` writes no ``optimizer_states``: none appear, so that
    resuming from the file fails as on one device ("Trying to restore optimizer state", issue 40)."""
    net = Net("mlp")
    torch.save({"state_dict": net.state_dict(), "global_step": 3}, tmp_path / "w.ckpt")
    part = stage_part(LazyCheckpoint(tmp_path / "w.ckpt"), net if module else None, None)
    assert "optimizer_states" not in part and set(part["state_dict"]) == set(net.state_dict())
    torch.save({"state_dict": net.state_dict(), "optimizer_states": []}, tmp_path / "full.ckpt")
    assert (
        stage_part(LazyCheckpoint(tmp_path / "full.ckpt"), net if module else None, None)["optimizer_states"]
        == []
    )
