"""Cutting into K·v parts: every stage holds v non-contiguous parts under the user's names; state moves
between any (K, v) and the plain module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.balance import (
    balance_by_memory,
    balance_by_parameters,
    balance_by_time,
    uniform_balance,
)
from lightning_gpipe.engine.stage import PipelineStage
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.partition.cut import (
    PartitionError,
    check_model,
    check_tied_parameters,
    cut,
    placement,
    virtual_cut,
)
from lightning_gpipe.partition.tied import find_tied
from lightning_gpipe.schedule import holder
from lightning_gpipe.state.materialize import materialize_layers, materialize_stage
from lightning_gpipe.strategy.balance_spec import check_balance_spec
from lightning_gpipe.transport.layout import Layout, layer_parts, layer_stages


def _net(seed: int = 0, width: int = 6, layers: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    body: list[nn.Module] = []
    for k in range(layers):
        body.append(nn.Linear(width, width) if k % 2 == 0 else nn.Tanh())
    return nn.Sequential(*body)


def _stages(seq: nn.Sequential, balance: list[int], k: int) -> list[PipelineStage]:
    layout = Layout(k, k)
    return [
        build_stage(seq, balance, layout, layout.rank(0, j), 4, "never", torch.device("cpu"))
        for j in range(k)
    ]


def _run_parts(stages: list[PipelineStage], x: torch.Tensor) -> torch.Tensor:
    """The pipeline's forward, part by part: part c on stage c mod K, its virtual stage c // K."""
    k, v = len(stages), len(stages[0].virtual_layers)
    for c in range(k * v):
        j, u = holder(c, k)
        x = stages[j].executor.local_forward(x, virtual_stage=u)
    return x


def test_stage_j_holds_parts_j_j_plus_k_and_so_on():
    seq = _net()
    names = [[n for n, _ in part] for part in virtual_cut(seq, [2, 2, 2, 2], 0, 2)]
    assert names == [["0", "1"], ["4", "5"]]
    assert [n for n, _ in cut(seq, [2, 2, 2, 2], 1, 2)] == ["2", "3", "6", "7"]
    assert layer_stages([2, 2, 2, 2], 2) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layer_stages([2, 2, 2, 2]) == [0, 0, 1, 1, 2, 2, 3, 3]  # one entry per stage: as before
    assert layer_parts([2, 1]) == [0, 0, 1]
    assert [n for n, _ in cut(seq, [3, 5], 1)] == ["3", "4", "5", "6", "7"]  # v = 1 unchanged
    with pytest.raises(PartitionError, match=r"a balance of 3 parts cannot be dealt to 2 stages"):
        virtual_cut(seq, [3, 3, 2], 0, 2)


def test_check_model_balances_over_stages_times_virtual_stages():
    class Module(nn.Module):
        automatic_optimization = True

        def __init__(self) -> None:
            super().__init__()
            self.layers = _net()

    model = Module()
    assert check_model(model, None, None, 2, 2)[2] == [2, 2, 2, 2]
    assert check_model(model, None, [1, 3, 2, 2], 2, 2)[2] == [1, 3, 2, 2]
    assert check_model(model, None, None, 3, 2)[2] == [2, 2, 1, 1, 1, 1]
    with pytest.raises(
        PartitionError, match=r"balance has 2 entries but the pipeline has 4 parts \(2 stages × 2"
    ):
        check_model(model, None, [4, 4], 2, 2)
    with pytest.raises(PartitionError, match=r"5 × 2 = 10 parts .*8 layers; use schedule='1f1b'"):
        check_model(model, None, None, 5, 2)
    with pytest.raises(PartitionError, match=r"more pipeline stages than layers \(stages: 9, layers: 8\)"):
        check_model(model, None, None, 9, 2)
    with pytest.raises(PartitionError, match=r"2 × 5 = 10 parts .*8 layers; use virtual_stages=4,"):
        check_model(model, None, None, 2, 5)
    with pytest.raises(PartitionError, match=r"balance has 5 entries but the pipeline has 4 parts"):
        check_model(model, None, [1, 1, 2, 2, 2], 2, 2)
    assert check_balance_spec([2, 2, 2, 2], 2, 2) == [2, 2, 2, 2]
    with pytest.raises(
        ValueError, match=r"balance has 2 entries but the pipeline has 2 stages × 2 virtual stages"
    ):
        check_balance_spec([4, 4], 2, 2)


@pytest.mark.parametrize("mode", ["uniform", "parameters", "time", "memory"])
def test_every_balance_mode_balances_over_k_times_v_parts(mode):
    seq = _net(layers=12)
    k, v = 2, 3
    sample = torch.randn(2, 6)
    chosen = {
        "uniform": lambda: uniform_balance(len(seq), k * v),
        "parameters": lambda: balance_by_parameters(seq, k * v),
        "time": lambda: balance_by_time(seq, sample, k * v, timeout=0.05),
        "memory": lambda: balance_by_memory(seq, sample, k * v),
    }[mode]()
    assert len(chosen) == k * v and sum(chosen) == len(seq) and min(chosen) >= 1
    stages = _stages(seq, chosen, k)
    assert sorted(n for s in stages for n in s.layer_names) == sorted(n for n, _ in seq.named_children())
    x = torch.randn(5, 6)
    torch.testing.assert_close(_run_parts(stages, x), seq(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("k", "balance"), [(1, [8]), (2, [4, 4]), (2, [2, 2, 2, 2]), (2, [1, 3, 2, 2]), (3, [2, 1, 1, 1, 2, 1])]
)
def test_a_stage_with_virtual_stages_runs_each_part_and_keeps_the_users_names(k, balance):
    seq = _net()
    stages = _stages(seq, balance, k)
    v = len(balance) // k
    for j, stage in enumerate(stages):
        assert stage.virtual_layers == [[n for n, _ in part] for part in virtual_cut(seq, balance, j, k)]
        assert len(stage.virtual_layers) == v
        layers = [n for part in stage.virtual_layers for n in part]
        assert list(stage.state_dict()) == [key for key in seq.state_dict() if key.split(".")[0] in layers]
    x = torch.randn(3, 6)
    torch.testing.assert_close(_run_parts(stages, x), seq(x), rtol=0, atol=0)


LAYOUTS = [
    (1, [8]),
    (2, [4, 4]),
    (4, [2, 2, 2, 2]),
    (2, [2, 2, 2, 2]),
    (2, [1, 1, 2, 4]),
    (3, [2, 1, 1, 1, 2, 1]),
]


@pytest.mark.parametrize(("k", "balance"), LAYOUTS)
def test_state_saved_under_one_k_v_loads_into_the_plain_module_and_any_other(k, balance):
    """The full state is the union of the stages' (keys: the user's names, in model order, as
    :func:`lightning_gpipe.state.gather_sequential_state` orders them); each stage of another
    layout takes exactly its keys."""
    trained = _net(seed=1)
    saved: dict[str, torch.Tensor] = {}
    for stage in _stages(trained, balance, k):
        saved.update(stage.state_dict())
    order = {n: i for i, n in enumerate(n for n, _ in trained.named_children())}
    saved = dict(sorted(saved.items(), key=lambda item: order[item[0].split(".")[0]]))
    assert list(saved) == list(trained.state_dict())
    plain = _net(seed=2)
    plain.load_state_dict(saved)
    x = torch.randn(4, 6)
    torch.testing.assert_close(plain(x), trained(x), rtol=0, atol=0)
    for k2, balance2 in LAYOUTS:
        fresh = _stages(_net(seed=3), balance2, k2)
        for stage in fresh:
            stage.load_state_dict({key: saved[key] for key in stage.state_dict()}, strict=True)
        torch.testing.assert_close(_run_parts(fresh, x), trained(x), rtol=0, atol=0)


def test_tied_parameters_are_tied_only_across_stages():
    seq = _net()
    seq[4].weight = seq[0].weight  # layers 0 and 4: parts 0 and 2 of [2, 2, 2, 2]
    assert find_tied(seq, [2, 2, 2, 2], 2) == []  # both on stage 0 with K = 2, v = 2
    tied = find_tied(seq, [4, 4])  # stages 0 and 1 without virtual stages
    assert [t.stages for t in tied] == [(0, 1)]
    bn = nn.Sequential(nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
    bn.append(bn[0])  # a shared buffer on parts 0 and 3
    check_tied_parameters(bn, [1, 1, 1, 2], 3)  # K = 3: parts 0 and 3 are both on stage 0
    with pytest.raises(PartitionError, match="the buffer '0.running_mean' is shared by layers on stages"):
        check_tied_parameters(bn, [1, 1, 1, 2], 2)


def test_placement_names_each_stages_parts():
    text = placement(_net(), [2, 2, 2, 2], [1, 0])
    assert text.splitlines() == [
        "gpipe: 2 stages × 2 virtual stages over 8 layers, 168 parameters in all",
        "  stage 0 (rank 1): layers 0..1 + 4..5, 84 parameters",
        "  stage 1 (rank 0): layers 2..3 + 6..7, 84 parameters",
    ]
    assert (
        placement(_net(), [4, 4], [1, 0]).splitlines()[0]
        == "gpipe: 2 stages over 8 layers, 168 parameters in all"
    )


def test_stage_only_materialization_seeds_each_layer_by_its_index_in_the_sequential(monkeypatch):
    """A meta model cut into K·v parts: stage 0's layer 4 gets the values layer 4 gets on one device."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    with torch.device("meta"):
        meta, whole = _net(), _net()
    materialize_layers(list(enumerate(whole)), seed=7)

    class Holder(nn.Module):
        def __init__(self, layers: nn.Sequential) -> None:
            super().__init__()
            self.layers = layers

    materialize_stage(Holder(meta), "layers", meta, [2, 2, 2, 2], 0, torch.device("cpu"), 2)
    for index in (0, 4):
        torch.testing.assert_close(meta[index].weight, whole[index].weight, rtol=0, atol=0)
    assert meta[2].weight.is_meta and meta[6].weight.is_meta  # stage 1's parts stay on the meta device


def test_the_strategy_refuses_virtual_stages_it_cannot_run_before_processes_start():
    from lightning_gpipe import GPipeStrategy
    from lightning_gpipe.engine.skip import Pop, Stash
    from lightning_gpipe.partition.cut import check_skips_within_parts
    from lightning_gpipe.schedule import check_virtual_stages

    assert GPipeStrategy(schedule="interleaved_1f1b", virtual_stages=2).virtual_stages == 2
    for schedule in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match=rf"the {schedule} schedule runs one virtual stage per stage"):
            GPipeStrategy(schedule=schedule, virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer >= 1 \(virtual_stages: 0\)"):
        GPipeStrategy(schedule="interleaved_1f1b", virtual_stages=0)
    with pytest.raises(
        ValueError, match=r"balance has 2 entries but the pipeline has 2 stages × 2 virtual stages"
    ):
        GPipeStrategy(schedule="interleaved_1f1b", virtual_stages=2, balance=[3, 2], pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"two or more pipeline stages \(stages: 1, virtual_stages: 2\)"):
        check_virtual_stages("interleaved_1f1b", 2, stages=1)
    skips = nn.Sequential(Stash("a", nn.Linear(6, 6)), nn.Tanh(), Pop("a"), nn.Linear(6, 6))
    check_skips_within_parts(skips, [3, 1])  # the pair in part 0
    with pytest.raises(
        PartitionError, match=r"skip connections across parts are not supported with virtual stages"
    ):
        check_skips_within_parts(skips, [1, 1, 1, 1])
