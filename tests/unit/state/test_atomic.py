"""Saves are atomic in both formats: a crash at any step of a save leaves the last good checkpoint
loadable, copies left behind go at the next save, and nothing is staged outside the target's directory."""

import os
import tempfile

import pytest
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.state import atomic
from lightning_gpipe.state.sharded import save_sharded
from lightning_gpipe.strategy import checkpoints
from tests.models import Net


class _Crash(BaseException):
    """The process dies here: no handler of the save runs (unlike an ``OSError``)."""


def _net(value):
    module = Net("mlp")
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)
    return module


def _save_full(path, value):
    module = _net(value)
    checkpoint = {"state_dict": module.state_dict(), "global_step": value}
    assert checkpoints.save("full", checkpoint, path, module, [], TorchCheckpointIO(), rank=0)


def _crash_at_replace(monkeypatch, n, error):
    """``os.replace`` raises ``error`` at its ``n``-th call (1-based), and runs before it."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == n:
            raise error
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def _full_value(path):
    """The fill value of the full checkpoint at ``path``, read as a strategy reads it."""
    strategy = GPipeStrategy()
    strategy.connect(Net("mlp"))
    loaded = strategy.load_checkpoint(path)
    return loaded["global_step"]


@pytest.mark.parametrize("error", [_Crash(), OSError("disk full")], ids=["crash", "error"])
def test_full_save_failing_at_its_replace_leaves_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "c.ckpt"
    _save_full(path, 1)
    calls = _crash_at_replace(monkeypatch, 1, error)
    with pytest.raises(type(error)):
        _save_full(path, 2)
    assert calls and _full_value(path) == 1
    monkeypatch.undo()
    _save_full(path, 3)
    assert _full_value(path) == 3 and atomic.leftovers(path) == []


def test_full_save_failing_while_writing_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    _save_full(path, 1)
    real = torch.save

    def half_save(obj, target):
        real(obj, target)
        with open(target, "r+b") as handle:
            handle.truncate(os.path.getsize(target) // 2)
        raise _Crash()

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(_Crash):
        _save_full(path, 2)
    monkeypatch.undo()
    assert _full_value(path) == 1 and len(atomic.leftovers(path)) == 1  # the half-written copy
    _save_full(path, 3)
    assert _full_value(path) == 3 and atomic.leftovers(path) == []


def test_full_save_stages_beside_the_target_not_in_tmpdir(tmp_path, monkeypatch):
    """``$TMPDIR`` on another directory (in practice another filesystem, where a move truncates the
    target first): nothing is written there, and the one replace stays in the target's directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    path = tmp_path / "out" / "c.ckpt"
    calls = _crash_at_replace(monkeypatch, 0, None)
    _save_full(path, 1)
    _save_full(path, 2)
    assert [os.path.dirname(src) for src, _ in calls] == [str(path.parent)] * 2
    assert [dst for _, dst in calls] == [path] * 2
    assert list(elsewhere.iterdir()) == [] and _full_value(path) == 2


def _save_sharded(path, value):
    module = _net(value)
    save_sharded({"global_step": value}, path, module, [module.configure_optimizers()])


def _sharded_value(path):
    """The fill value of the sharded checkpoint at ``path``, read as a strategy reads it (every
    parameter must hold it)."""
    strategy = GPipeStrategy()
    module = _net(-1)
    strategy.connect(module)
    loaded = strategy.load_checkpoint(path)
    values = {float(v) for p in module.parameters() for v in p.detach().flatten()}
    assert values == {float(loaded["global_step"])}
    return loaded["global_step"]


# the sharded save's os.replace calls: 1 lightning_meta.pt into the staged directory, 2 the old checkpoint
# aside, 3 the staged directory to the path
@pytest.mark.parametrize(("n", "loads"), [(1, 1), (2, 1), (3, 2)])
def test_sharded_save_crashing_at_each_rename_leaves_a_complete_checkpoint(tmp_path, monkeypatch, n, loads):
    path = tmp_path / "s.ckpt"
    _save_sharded(path, 1)
    calls = _crash_at_replace(monkeypatch, n, _Crash())
    with pytest.raises(_Crash):
        _save_sharded(path, 2)
    monkeypatch.undo()
    assert len(calls) == n
    if n == 3:  # between the renames: the path is missing, both complete copies lie beside it
        assert not path.exists()
        with pytest.warns(UserWarning, match=r"does not exist: a save was interrupted .* complete"):
            assert _sharded_value(path) == loads
    else:
        assert _sharded_value(path) == loads
    _save_sharded(path, 3)
    assert _sharded_value(path) == 3 and atomic.leftovers(path) == []


def test_sharded_save_crashing_while_writing_shards_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "s.ckpt"
    _save_sharded(path, 1)
    real = checkpoints.sharded.dcp.save

    def crash_after_shards(*args, **kwargs):
        real(*args, **kwargs)
        raise _Crash()

    monkeypatch.setattr(checkpoints.sharded.dcp, "save", crash_after_shards)
    with pytest.raises(_Crash):
        _save_sharded(path, 2)
    monkeypatch.undo()
    assert _sharded_value(path) == 1
    os.rename(path, tmp_path / "moved.ckpt")  # the path missing: an incomplete copy is never loaded
    with pytest.raises(FileNotFoundError):
        _sharded_value(path)
