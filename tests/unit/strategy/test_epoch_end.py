"""On stages other than the last, the module's epoch-end hooks' errors are settled by the last stage's
outcome in the share that follows: dropped with a warning where the last stage's hook succeeded,
raised where it failed; the last stage's own errors are never held."""

import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_gpipe.errors import RankFailed
from lightning_gpipe.strategy import epoch_end
from lightning_gpipe.strategy.epoch_end import guard_epoch_end_hooks, resolve_held, unguard_epoch_end_hooks


class _Outputs(pl.LightningModule):
    """Lightning 2's migration-guide pattern: step outputs collected for the epoch-end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step_outputs: list[torch.Tensor] = []
        self.validation_step_outputs: list[torch.Tensor] = []
        self.test_step_outputs: list[torch.Tensor] = []
        self.means: list[float] = []

    def on_train_epoch_end(self):
        self.means.append(float(torch.stack(self.training_step_outputs).mean()))

    def on_validation_epoch_end(self):
        self.means.append(float(torch.stack(self.validation_step_outputs).mean()))

    def on_test_epoch_end(self):
        self.means.append(float(torch.stack(self.test_step_outputs).mean()))


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(epoch_end, "_warned", set())


@pytest.mark.parametrize("hook", ["on_validation_epoch_end", "on_test_epoch_end"])
def test_a_non_last_stage_error_is_dropped_with_a_warning_once_when_the_last_stage_shares(hook):
    module, held, shared = _Outputs(), {}, []
    guard_epoch_end_hooks(module, False, lambda: shared.append("train"), held)
    getattr(module, hook)()  # the list is empty on this stage: torch.stack raises, held
    assert list(held) == [hook] and isinstance(held[hook], RuntimeError)
    with pytest.warns(UserWarning, match=f"{hook} raised RuntimeError: stack expects a non-empty"):
        resolve_held(lambda: shared.append("share"), held)
    assert held == {} and shared == ["share"]
    getattr(module, hook)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per hook
        resolve_held(lambda: None, held)


def test_a_non_last_stage_error_is_raised_when_the_last_stage_failed():
    module, held = _Outputs(), {}
    guard_epoch_end_hooks(module, False, lambda: None, held)
    module.on_validation_epoch_end()
    last_failed = RankFailed(
        "sharing epoch metrics over pipeline 0 needs every rank, but stage 1 (rank 0) failed"
    )

    def share():
        raise last_failed

    with pytest.raises(RuntimeError, match="stack expects a non-empty") as caught:
        resolve_held(share, held)
    assert caught.value.__cause__ is last_failed and held == {}
    with pytest.raises(RankFailed):  # nothing held: the share's own error
        resolve_held(share, held)


def test_the_train_hook_shares_after_the_users_code_and_settles_there():
    module, held, shared = _Outputs(), {}, []
    guard_epoch_end_hooks(module, False, lambda: shared.append("share"), held)
    with pytest.warns(UserWarning, match="on_train_epoch_end raised RuntimeError"):
        module.on_train_epoch_end()
    assert shared == ["share"] and held == {}
    module.training_step_outputs.append(torch.tensor(2.0))
    module.on_train_epoch_end()  # no error: shares, no warning
    assert shared == ["share", "share"] and module.means == [2.0]


def test_the_last_stage_raises_its_own_errors_at_once():
    module, held = _Outputs(), {}
    guard_epoch_end_hooks(module, True, lambda: None, held)
    for hook in ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end"):
        with pytest.raises(RuntimeError, match="stack expects a non-empty"):
            getattr(module, hook)()
    assert held == {}


def test_unguard_gives_the_class_hooks_back():
    module = _Outputs()
    guard_epoch_end_hooks(module, False, lambda: None, {})
    unguard_epoch_end_hooks(module)
    assert not {"on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end"} & set(vars(module))
    with pytest.raises(RuntimeError, match="stack expects a non-empty"):
        module.on_validation_epoch_end()
