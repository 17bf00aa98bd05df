"""Optimizers as users write them: parameter groups merged and split by name and hyper-parameters,
stages whose parameters are all frozen, first or in the middle (CPU, Gloo, hard timeouts)."""

import torch

from lightning_gpipe.state.optimizer import NAMES_KEY, merge_optimizer_states, split_optimizer_state


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
