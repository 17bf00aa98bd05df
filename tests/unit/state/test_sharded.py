"""Saved state: per-stage optimizer states merged into the plain model's, and split back for any
stage count; a sharded checkpoint's optimizer state of a tied copy under the model's name."""

from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_gpipe.partition.cut import PLACEHOLDER, add_placeholder_parameter, cut
from lightning_gpipe.state.optimizer import (
    NAMES_KEY,
    CheckpointError,
    drop_placeholder,
    drop_placeholder_names,
    group_names,
    merge_optimizer_states,
    split_optimizer_state,
)
from lightning_gpipe.state.sharded import load_sharded, save_sharded, set_sharded_optimizer_states


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _groups(module):
    """Two parameter groups, weights and biases, as configure_optimizers might build them."""
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "lr": 0.1}, {"params": biases, "lr": 0.01}]


def _trained(model):
    """One Adam step on the whole model, and one per stage (balance [2, 3]) on a copy with the same
    gradients."""
    x = torch.randn(5, 3)
    model(x).sum().backward()
    whole = torch.optim.Adam(_groups(model))
    whole.step()
    stages = []
    for j in range(2):
        part = nn.Sequential(
            OrderedDict(cut(model, [2, 3], j))
        )  # shares the trained parameters and gradients
        optimizer = torch.optim.Adam(_groups(part))
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {k: v.clone() for k, v in whole.state[p].items()}
        names = group_names(optimizer, {id(p): n for n, p in part.named_parameters()})
        stages.append((optimizer.state_dict(), names))
    return whole, stages


def test_merged_stage_states_equal_one_optimizer_over_the_whole_model():
    model = _model()
    whole, stages = _trained(model)
    merged = merge_optimizer_states(stages)
    plain = whole.state_dict()
    names_by_group = [[n for n, p in model.named_parameters() if n.endswith(s)] for s in ("weight", "bias")]
    assert merged[NAMES_KEY] == [n for names in names_by_group for n in names]
    # one optimizer over the whole model numbers weights 0..2 then biases 3..5, as the merge does
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in plain["param_groups"]]
    assert [g["lr"] for g in merged["param_groups"]] == [0.1, 0.01]
    assert merged["state"].keys() == plain["state"].keys()
    for k, state in plain["state"].items():
        for field, value in state.items():
            assert torch.equal(merged["state"][k][field], value), (k, field)


@pytest.mark.parametrize("balance", [[5], [2, 3], [1, 2, 2], [1, 1, 1, 1, 1]])
def test_split_gives_each_stage_its_parameters_state_for_any_stage_count(balance):
    model = _model()
    whole, stages = _trained(model)
    merged = merge_optimizer_states(stages)
    by_name = {n: whole.state[p] for n, p in model.named_parameters()}
    for j in range(len(balance)):
        part = nn.Sequential(OrderedDict(cut(model, balance, j)))
        optimizer = torch.optim.Adam(_groups(part)) if any(True for _ in part.parameters()) else None
        if optimizer is None:
            continue
        names = group_names(optimizer, {id(p): n for n, p in part.named_parameters()})
        local = split_optimizer_state(merged, names)
        optimizer.load_state_dict(local)
        for name, p in part.named_parameters():
            for field, value in by_name[name].items():
                assert torch.equal(optimizer.state[p][field], value), (j, name, field)
        assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]


def test_placeholder_parameter_never_reaches_state_dict_or_merged_state():
    stage = nn.Sequential(nn.ReLU())
    add_placeholder_parameter(stage, torch.device("cpu"))
    assert PLACEHOLDER in dict(stage.named_parameters()) and stage.state_dict() == {}
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    names = group_names(optimizer, {id(p): n for n, p in stage.named_parameters()})
    cleaned = drop_placeholder(optimizer.state_dict(), names)
    assert cleaned["param_groups"][0]["params"] == [] and drop_placeholder_names(names) == [[]]
    assert merge_optimizer_states([(cleaned, drop_placeholder_names(names))])[NAMES_KEY] == []
    with_params = nn.Sequential(nn.Linear(1, 1))
    add_placeholder_parameter(with_params, torch.device("cpu"))
    assert PLACEHOLDER not in dict(with_params.named_parameters())  # only a stage without parameters gets one


def test_merge_and_split_refuse_mismatched_groups_and_unknown_parameters():
    """Stages may hold different numbers of groups (issue 10: [1, 2] merges by hyper-parameters); a local
    group whose parameters the checkpoint keeps in two groups, or an unknown parameter, is refused."""
    model = _model()
    _, stages = _trained(model)
    one_group = ({**stages[1][0], "param_groups": stages[1][0]["param_groups"][:1]}, stages[1][1][:1])
    assert len(merge_optimizer_states([stages[0], one_group])["param_groups"]) == 2
    merged = merge_optimizer_states(stages)
    with pytest.raises(CheckpointError, match="'elsewhere.weight' has no optimizer state"):
        split_optimizer_state(merged, [["elsewhere.weight"], []])
    first, second = (merged[NAMES_KEY][g["params"][0]] for g in merged["param_groups"][:2])
    with pytest.raises(CheckpointError, match="are in 2 different groups of the checkpoint"):
        split_optimizer_state(merged, [[first, second]])
    with pytest.raises(CheckpointError, match="no parameter names"):
        split_optimizer_state({k: v for k, v in merged.items() if k != NAMES_KEY}, [[], []])


def _head(seed):
    """A last stage holding a tied copy: ``head.weight`` is tied to ``embed.tok.weight`` on another stage."""
    torch.manual_seed(seed)
    stage = nn.Module()
    stage.norm, stage.head = nn.LayerNorm(4), nn.Linear(4, 3, bias=False)
    return stage, torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)


def test_a_tied_copys_optimizer_state_is_saved_and_read_under_the_models_first_name(tmp_path):
    """The stage holding a tied copy writes its optimizer state under the name the whole model gives the
    parameter (``embed.tok.weight``: what the owner's stage, and a whole model after ``fit``, write), so
    every save names it alike; reading gives it back under the stage's own name, to the copy."""
    stage, optimizer = _head(0)
    stage.head(stage.norm(torch.randn(5, 4))).sum().backward()
    optimizer.step()
    aliases = {"head.weight": "embed.tok.weight"}
    save_sharded({"epoch": 0}, tmp_path / "ckpt", stage, [optimizer], aliases)
    saved = set(dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    assert "optimizers.0.state.embed.tok.weight.momentum_buffer" in saved
    assert "optimizers.0.param_groups.embed.tok.weight.lr" in saved
    assert not {k for k in saved if k.startswith("optimizers.") and ".head.weight." in k}
    assert {"model.head.weight", "optimizers.0.state.norm.weight.momentum_buffer"} <= saved
    fresh, again = _head(1)
    fresh.head(fresh.norm(torch.randn(5, 4))).sum().backward()
    again.step()  # a state to overwrite
    loaded = load_sharded(tmp_path / "ckpt", fresh, [again], aliases=aliases)
    set_sharded_optimizer_states(fresh, [again], loaded["optimizer_states"])
    for p, q in zip(stage.parameters(), fresh.parameters()):
        assert torch.equal(again.state[q]["momentum_buffer"], optimizer.state[p]["momentum_buffer"])
