"""Optimizers as users write them: parameter groups merged and split by name and hyper-parameters,
stages whose parameters are all frozen, first or in the middle (CPU, Gloo, hard timeouts)."""

import pytest
import torch

from lightning_gpipe.state.optimizer import NAMES_KEY, merge_optimizer_states, split_optimizer_state
from tests.conftest import max_diff
from tests.models import Net, pl, train_single_device


def _sd(groups):
    """A stage's optimizer state_dict: ``groups`` = [(weight_decay, [state value per parameter])]."""
    state, param_groups, k = {}, [], 0
    for wd, values in groups:
        params = []
        for v in values:
            state[k] = {"v": torch.tensor(float(v))}
            params.append(k)
            k += 1
        param_groups.append({"weight_decay": wd, "lr": 0.01, "params": params})
    return {"state": state, "param_groups": param_groups}


def test_groups_merge_by_hyper_parameters_in_model_order_and_split_by_name():
    """Stage 0 lists (decay, no decay), stage 1 (no decay, decay), stage 2 only decay: one merged
    optimizer whose groups and parameters are in model order, each stage split back to its own."""
    order = ["a.w", "a.b", "b.n", "b.w", "b.b", "c.w"]
    parts = [
        (_sd([(0.1, [1]), (0.0, [2])]), [["a.w"], ["a.b"]]),
        (_sd([(0.0, [3, 5]), (0.1, [4])]), [["b.n", "b.b"], ["b.w"]]),
        (_sd([(0.1, [6])]), [["c.w"]]),
    ]
    merged = merge_optimizer_states(parts, order)
    assert [g["weight_decay"] for g in merged["param_groups"]] == [0.1, 0.0]
    by_group = [[merged[NAMES_KEY][i] for i in g["params"]] for g in merged["param_groups"]]
    assert by_group == [["a.w", "b.w", "c.w"], ["a.b", "b.n", "b.b"]]
    values = {merged[NAMES_KEY][i]: float(s["v"]) for i, s in merged["state"].items()}
    assert values == {"a.w": 1, "a.b": 2, "b.n": 3, "b.b": 5, "b.w": 4, "c.w": 6}
    back = split_optimizer_state(merged, [["b.n", "b.b"], ["b.w"]])
    assert [g["weight_decay"] for g in back["param_groups"]] == [0.0, 0.1]
    assert [float(back["state"][i]["v"]) for i in (0, 1, 2)] == [3, 5, 4]


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
