"""Balance: the exact min-max partition, the layer profiler, and the public balancers."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_gpipe.balance import (
    LayerProfilingError,
    balance_by_memory,
    balance_by_parameters,
    balance_by_size,
    balance_by_time,
    balance_cost,
    profile_layers,
    uniform_balance,
)
from lightning_gpipe.balance.blockpartition import solve, stage_costs

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------
# partition algorithm


def all_balances(layers: int, partitions: int):
    """Every balance of ``layers`` into ``partitions`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), partitions - 1):
        bounds = (0, *cuts, layers)
        yield [bounds[j + 1] - bounds[j] for j in range(partitions)]


def brute_force(costs, partitions):
    """The documented tie-break by exhaustive search: (costs desc, sizes desc, -balance)."""

    def key(balance):
        return (
            sorted(stage_costs(costs, balance), reverse=True),
            sorted(balance, reverse=True),
            [-n for n in balance],
        )

    return min(all_balances(len(costs), partitions), key=key)


@pytest.mark.parametrize(
    ("costs", "partitions", "expected"),
    [
        ([1, 1, 10, 1, 1], 3, [2, 1, 2]),
        ([10, 1, 1, 1, 1], 2, [1, 4]),
        ([10, 1, 1, 1, 1], 3, [1, 2, 2]),  # leximin: stages 10, 2, 2 beat 10, 1, 3
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 2, 2]),  # stages cost 15, 13, 17
        ([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 4, [3, 3, 2, 2]),  # zero costs: uniform
        ([1.0] * 7, 3, [3, 2, 2]),
        ([5.0], 1, [1]),
        ([3, 1, 4, 1, 5], 5, [1, 1, 1, 1, 1]),
    ],
)
def test_solve_hand_cases(costs, partitions, expected):
    assert solve(costs, partitions) == expected
    assert balance_cost(costs, partitions) == expected
    assert expected == brute_force(costs, partitions)


costs_lists = st.lists(
    st.one_of(
        st.integers(min_value=0, max_value=4).map(float),  # many ties
        st.floats(min_value=0, max_value=100, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=300, deadline=None)
@given(costs=costs_lists, data=st.data())
def test_solve_matches_brute_force(costs, data):
    partitions = data.draw(st.integers(min_value=1, max_value=min(4, len(costs))))
    balance = solve(costs, partitions)

    assert len(balance) == partitions
    assert all(n >= 1 for n in balance)
    assert sum(balance) == len(costs)
    optimum = min(max(stage_costs(costs, b)) for b in all_balances(len(costs), partitions))
    assert max(stage_costs(costs, balance)) == optimum
    assert balance == brute_force(costs, partitions)  # the documented tie-break


def test_solve_is_fast_for_hundreds_of_layers():
    costs = [float((i * 7919) % 13 + 1) for i in range(300)]
    start = time.perf_counter()
    balance = solve(costs, 8)
    assert time.perf_counter() - start < 5.0
    assert sum(balance) == 300 and len(balance) == 8


@pytest.mark.parametrize("partitions", [0, -1])
def test_solve_rejects_fewer_than_one_partition(partitions):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        solve([1.0, 2.0], partitions)


def test_more_stages_than_layers_names_both_numbers_and_the_fix():
    with pytest.raises(ValueError) as info:
        solve([1.0, 2.0, 3.0], 5)
    message = str(info.value)
    assert "stages: 5" in message and "layers: 3" in message
    assert "at most 3 stages" in message


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_solve_rejects_negative_nan_and_infinite_costs(bad):
    with pytest.raises(ValueError, match="layer 1"):
        solve([1.0, bad, 1.0], 2)


def test_solve_rejects_non_int_partitions():
    with pytest.raises(TypeError):
        solve([1.0, 2.0], 2.0)  # type: ignore[arg-type]


def test_uniform_balance_puts_larger_stages_first():
    assert uniform_balance(10, 4) == [3, 3, 2, 2]
    assert uniform_balance(8, 4) == [2, 2, 2, 2]
    assert uniform_balance(3, 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="stages: 4, layers: 3"):
        uniform_balance(3, 4)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        uniform_balance(3, 0)


def test_balance_by_parameters_spreads_parameterless_layers():
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    assert balance_by_parameters(model, 2) == [2, 3]  # 320 | 4160 + 130
    assert balance_by_parameters(model, 5) == [1, 1, 1, 1, 1]
    with pytest.raises(TypeError, match="nn.Sequential"):
        balance_by_parameters(nn.Linear(2, 2), 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# profiler


class Sleep(nn.Module):
    """A layer whose forward takes ``seconds``: a cost that CPU contention cannot blur."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


class Spread(nn.Module):
    """Saves ``factor`` times its input for backward and returns the input's shape."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        big = x.repeat(1, self.factor)
        return (big**2).view(x.shape[0], self.factor, -1).sum(1)


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in forward")


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("boom in backward")


class BoomBackward(nn.Module):
    def forward(self, x):
        return _FailingBackward.apply(x)


class Pair(nn.Module):
    """Takes a tensor or a pair, returns a pair: layers may pass tuples along."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        a, b = x if isinstance(x, tuple) else (x, x)
        return self.linear(a), torch.tanh(b)


class Merge(nn.Module):
    def forward(self, pair):
        a, b = pair
        return a * b


def test_balance_by_time_isolates_a_layer_ten_times_costlier():
    model = nn.Sequential(Sleep(0.002), Sleep(0.002), Sleep(0.02), Sleep(0.002), Sleep(0.002))
    sample = torch.randn(2, 4)
    assert balance_by_time(model, sample, 3, timeout=0.1) == [2, 1, 2]


def test_balance_by_memory_isolates_a_layer_saving_ten_times_more():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Spread(10), nn.Tanh(), nn.Tanh())
    sample = torch.randn(64, 8)
    assert balance_by_memory(model, sample, 3, optimizer_factor=0.0) == [2, 1, 2]
    assert balance_by_size is balance_by_memory


def test_profile_counts_saved_activations_parameters_and_times():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    profiles = profile_layers(model, torch.randn(8, 16), timeout=0.0, min_repeats=2)

    assert [p.layer_class for p in profiles] == ["Linear", "ReLU", "Linear"]
    assert [p.parameters for p in profiles] == [16 * 32 + 32, 0, 32 * 4 + 4]
    assert profiles[0].parameter_bytes == (16 * 32 + 32) * 4
    # Linear saves its input (weights are parameters, not activations); ReLU its output
    assert [p.activation_bytes for p in profiles] == [8 * 16 * 4, 8 * 32 * 4, 8 * 32 * 4]
    assert all(p.forward_time > 0 and p.backward_time > 0 for p in profiles)
    assert profiles[0].memory(3.0) == 8 * 16 * 4 + 4 * profiles[0].parameter_bytes


def test_profile_passes_tuples_between_layers():
    model = nn.Sequential(Pair(), Pair(), Merge())
    profiles = profile_layers(model, (torch.randn(4, 8), torch.randn(4, 8)), timeout=0.0)
    assert len(profiles) == 3
    assert profiles[1].activation_bytes > 0  # layer 0's linear output requires grad


class DictIn(nn.Module):
    """``{"x": (N, 8), "mask": (N, 8)}`` → ``{"h": linear(x * mask), "mask", "pair": (h, h)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, batch: dict) -> dict:
        h = self.linear(batch["x"] * batch["mask"])
        return {"h": h, "mask": batch["mask"], "pair": (h, h)}


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, batch: dict) -> dict:
        h = self.linear(batch["h"] + batch["pair"][0]) * batch["mask"]
        return {**batch, "h": h}


def test_profile_passes_dicts_between_layers_and_backpropagates_through_them():
    # a causal LM's layers pass {"hidden_states", "attention_mask", "position_embeddings": (cos, sin)}
    model = nn.Sequential(DictIn(), DictBlock(), DictBlock())
    sample = {"x": torch.randn(4, 8), "mask": torch.ones(4, 8)}
    profiles = profile_layers(model, sample, timeout=0.0, min_repeats=2)
    # each block saves its linear's input (4 x 8 floats) and the product's operands: > 0 only if the
    # dict's "h" arrived requiring grad
    assert all(p.activation_bytes >= 4 * 8 * 4 for p in profiles[1:])
    assert all(p.backward_time > 0 for p in profiles)
    assert sum(balance_by_time(model, sample, 2, timeout=0.0)) == 3
    assert sum(balance_by_memory(model, sample, 2)) == 3


@pytest.mark.parametrize(
    ("bad", "cause", "where"),
    [(Boom(), ValueError, "forward"), (BoomBackward(), ArithmeticError, "backward")],
)
def test_failing_layer_error_names_the_layer_and_chains_the_cause(bad, cause, where):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), bad, nn.ReLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(LayerProfilingError) as info:
        balance_by_time(model, torch.randn(8, 4), 2, timeout=0.0)

    message = str(info.value)
    assert "layer 2" in message and type(bad).__name__ in message and where in message
    assert isinstance(info.value.__cause__, cause)
    for key, value in model.state_dict().items():  # restored even on failure
        assert torch.equal(value, before[key]), key


def test_profiling_leaves_parameters_batchnorm_stats_grads_and_modes_unchanged():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.eval()
    model[1].train()  # a mixed mode must come back as it was
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    sample = torch.randn(16, 4)

    balance_by_time(model, sample, 2, timeout=0.0)
    balance_by_memory(model, sample, 2)
    profile_layers(model, sample, timeout=0.0, device="cpu")

    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert int(model[1].num_batches_tracked) == 0
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == modes


def test_profile_rejects_bad_arguments():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        profile_layers(model, torch.randn(1, 2), timeout=-1.0)
    with pytest.raises(ValueError, match="stages: 2, layers: 1"):
        balance_by_time(model, torch.randn(1, 2), 2)
    with pytest.raises(ValueError, match="optimizer_factor"):
        balance_by_memory(model, torch.randn(1, 2), 1, optimizer_factor=-1.0)


def test_parameters_balance_isolates_the_big_layer():
    from lightning_gpipe.balance import balance_by_parameters

    seq = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 400), nn.Linear(400, 4), nn.Linear(4, 4)
    )
    assert balance_by_parameters(seq, 3) == [2, 1, 2]
