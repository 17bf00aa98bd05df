"""Optimizers as users write them: parameter groups merged and split by name and hyper-parameters,
stages whose parameters are all frozen, first or in the middle (CPU, Gloo, hard timeouts)."""

import pytest
import torch

from tests.conftest import max_diff
from tests.models import Net, pl, train_single_device

# (kind, devices, [(balance, Net options)]): one multi-process job per case, each run saved after 2 steps
# and resumed to 4
_JOBS = {
    "two_stages": (
        "ln",
        2,
        [
            ([4, 2], {"groups": "bias_norm"}),
            ([4, 2], {"groups": "norm"}),
            ([2, 4], {"groups": "frozen", "freeze_first": True}),
            ([4, 2], {"groups": "head"}),
        ],
    ),
    # issue 10 section 5: the middle stage's layers (2, 3: Linear, Tanh) all frozen
    "frozen_middle_stage": ("mlp", 3, [([2, 2, 1], {"groups": "frozen", "freeze": [2]})]),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("job", list(_JOBS))
def test_groups_and_frozen_stage_save_and_resume_like_one_device(gpipe_job, tmp_path, job):
    """Linear, Tanh, Linear, Tanh, LayerNorm, Linear over [4, 2] with AdamW decay / no-decay groups built
    from named_parameters() (group order differs per stage; or 1 group on stage 0, 2 on stage 1); layer
    0 frozen over [2, 4] with Adam(filter(requires_grad)); a head-only learning-rate group named by
    ``self.layers[-1]`` and ``self.layers[:-1]`` in configure_optimizers; and the middle stage of 3 all
    frozen ([2, 2, 1], filtered Adam: an empty parameter list there). Save after 2 steps, resume to 4:
    every step's loss and the final parameters equal to one device's save -> resume, the frozen layers
    unchanged, and a plain one-device Trainer resumes from the pipeline's checkpoint."""
    kind, devices, cases = _JOBS[job]
    extra = {"max_epochs": 3}
    results, _ = gpipe_job(
        kind,
        devices,
        [{"chunks": 2, "balance": b, "net": n} for b, n in cases],
        steps=2,
        save="two{k}.ckpt",
        resume={"ckpt": str(tmp_path / "two{k}.ckpt"), "steps": 4},
        trainer=extra,
        timeout=400,
    )
    for k, (_, net) in enumerate(cases):
        first, trainer = train_single_device(
            kind, 0, steps=2, return_trainer=True, trainer_extra=extra, **net
        )
        trainer.save_checkpoint(tmp_path / f"one{k}.ckpt")
        resumed = train_single_device(
            kind, 0, steps=4, ckpt_path=str(tmp_path / f"one{k}.ckpt"), trainer_extra=extra, **net
        )
        ours = results[k]
        assert len(ours["losses"]) == len(first.losses) == 2, net
        assert max(abs(a - b) for a, b in zip(ours["losses"], first.losses)) <= 1e-5, net
        assert len(ours["resumed_losses"]) == len(resumed.losses) == 2, net
        assert max(abs(a - b) for a, b in zip(ours["resumed_losses"], resumed.losses)) <= 1e-5, net
        assert max_diff(ours["state"], resumed.state_dict()) <= 1e-5, net
        frozen = net.get("freeze", [0] if net.get("freeze_first") else [])
        if frozen:
            pl.seed_everything(0, verbose=False)
            start = Net(kind, **net).state_dict()
            names = [n for n in start if n.startswith("layers.") and int(n.split(".")[1]) in frozen]
            assert names, net
            assert all(torch.equal(ours["state"][n], start[n]) for n in names), net
        cross = train_single_device(
            kind, 0, steps=4, ckpt_path=str(tmp_path / f"two{k}.ckpt"), trainer_extra=extra, **net
        )
        assert max_diff(cross.state_dict(), resumed.state_dict()) <= 1e-5, net
