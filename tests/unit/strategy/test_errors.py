"""Misuse gets a clear error: before any process starts where possible, else at the first step."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_gpipe
from lightning_gpipe import GPipeStrategy, PartitionError
from lightning_gpipe.strategy import sharding
from tests.gpt import GPT
from tests.llama import Llama
from tests.models import Net, make_data, trainer_kwargs


class OutsideParams(Net):
    def __init__(self):
        super().__init__("mlp")
        self.scale = nn.Parameter(torch.ones(1))


class TwoSequentials(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2))
        self.b = nn.Sequential(nn.Linear(2, 2))


def _fit_before_spawn(model, devices=2, **strategy_kwargs):
    """Run fit in this process; the error must come before the launcher starts any child."""
    trainer = pl.Trainer(strategy=GPipeStrategy(**strategy_kwargs), devices=devices, **trainer_kwargs(1))
    with pytest.raises(PartitionError) as info:
        trainer.fit(model, make_data("mlp", 10, 1))
    assert trainer.strategy.launcher.procs == [], "no child process may start"
    return str(info.value)


def test_registered_strategy_name():
    trainer = pl.Trainer(strategy="gpipe", devices=2, **trainer_kwargs(1))
    assert isinstance(trainer.strategy, GPipeStrategy)
    lightning_gpipe.GPipeStrategy.register_strategies(pl.strategies.StrategyRegistry)  # idempotent


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunks": 0}, r"chunks must be an integer >= 1 \(chunks: 0\)"),
        (
            {"checkpoint": "sometimes"},
            r"checkpoint must be one of 'always', 'except_last', 'never' \(checkpoint: 'sometimes'\)",
        ),
        ({"balance": [2, 0, 3]}, r"balance entries must be positive integers \(balance: \[2, 0, 3\]\)"),
        ({"balance": "time2"}, r"balance must be"),
        ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size must be an integer >= 1"),
        ({"schedule": "bogus"}, r"schedule must be one of 'gpipe', '1f1b'.*\(schedule: 'bogus'\)"),
        (
            {"balance": [2, 3], "pipeline_parallel_size": 3},
            r"balance has 2 stages but pipeline_parallel_size is 3",
        ),
        ({"signal_grace": 0}, r"signal_grace must be a number of seconds > 0 \(signal_grace: 0\)"),
        ({"data_parallel_size": 0}, r"data_parallel_size must be an integer >= 1, 'auto' or None \(got 0\)"),
        (
            {"data_parallel_size": 2.0},
            r"data_parallel_size must be an integer >= 1, 'auto' or None \(got 2.0\)",
        ),
        ({"tensor_parallel_size": "2"}, r"tensor_parallel_size must be an integer >= 1, 'auto' or None"),
        (
            {"data_parallel": "zero"},
            r"data_parallel must be one of 'replicate', 'fsdp' \(data_parallel: 'zero'\)",
        ),
        ({"signal_grace": "30"}, r"signal_grace must be a number of seconds > 0 \(signal_grace: '30'\)"),
        ({"batch_norm": "micro"}, r"batch_norm='micro' is not one of 'batch' .* or 'micro_batch'"),
        (
            {"deferred_batch_norm": "False"},
            r"deferred_batch_norm must be True or False \(deferred_batch_norm: 'False'\)",
        ),
        ({"deferred_batch_norm": 1}, r"deferred_batch_norm must be True or False \(deferred_batch_norm: 1\)"),
    ],
)
def test_bad_strategy_arguments_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**kwargs)


def test_a_count_that_is_not_an_integer_is_a_type_error_with_the_count_message():
    with pytest.raises(TypeError, match=r"chunks must be an integer >= 1 \(chunks: 2.5\)"):
        GPipeStrategy(chunks=2.5)


def test_world_not_multiple_of_pipeline_size_raises_at_trainer():
    with pytest.raises(ValueError, match=r"world size: 3, pipeline_parallel_size: 2"):
        pl.Trainer(strategy=GPipeStrategy(pipeline_parallel_size=2), devices=3, **trainer_kwargs(1))


@pytest.mark.parametrize(
    ("sizes", "devices", "message"),
    [
        ({"pipeline_parallel_size": 2, "data_parallel_size": 2}, 3, r"2 × 2 × 1 = 4, world size: 3"),
        ({"data_parallel_size": 2}, 3, r"world size: 3, data_parallel_size: 2\); set devices × num_nodes"),
        (
            {"pipeline_parallel_size": 3, "data_parallel_size": 1, "tensor_parallel_size": 1},
            2,
            r"3 × 1 × 1 = 3",
        ),
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_raises_at_trainer(sizes, devices, message):
    with pytest.raises(ValueError, match=message):
        pl.Trainer(strategy=GPipeStrategy(**sizes), devices=devices, **trainer_kwargs(1))


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [({}, (4, 1)), ({"data_parallel_size": 2}, (2, 2)), ({"pipeline_parallel_size": 1}, (1, 4))],
)
def test_the_size_left_out_is_inferred_from_the_devices(sizes, expected):
    trainer = pl.Trainer(strategy=GPipeStrategy(**sizes), devices=4, **trainer_kwargs(1))
    layout = trainer.strategy.layout
    assert (layout.stages, layout.replicas, layout.tensors) == (*expected, 1)
    assert trainer.strategy.distributed_sampler_kwargs["num_replicas"] == expected[1]
    assert trainer.strategy.device_mesh is None  # built with the process groups, at setup


def test_parameters_outside_sequential_raise_before_spawn():
    message = _fit_before_spawn(OutsideParams())
    assert "no nn.Sequential holding all of its parameters" in message and "module_name" in message


class TiedBiases(Net):
    """Net("mlp") whose third layer's bias is its first layer's."""

    def __init__(self):
        super().__init__("mlp")
        self.layers[2].bias = self.layers[0].bias


def test_fsdp_with_parameters_outside_the_sequential_or_tied_across_virtual_stages_is_refused_before_spawn():
    """data_parallel="fsdp" (issue 42): FSDP shards the stages' layers; a parameter outside them, or one
    shared by layers in two virtual stages of one stage (FSDP shards the layers sharing it as one group,
    whose forward cannot interleave with other micro-batches), is refused before any process starts, saying
    what to do. Tied across stages, or inside one part, it passes."""
    fsdp = {"data_parallel": "fsdp", "pipeline_parallel_size": 2}
    message = _fit_before_spawn(OutsideParams(), module_name="layers", **fsdp)
    assert "parameters outside the pipelined nn.Sequential 'layers': scale" in message
    interleaved = {**fsdp, "schedule": "interleaved_1f1b", "balance": [1, 1, 1, 2]}
    message = _fit_before_spawn(TiedBiases(), **interleaved)
    assert (
        "data_parallel='fsdp' cannot shard a parameter shared by two virtual stages of one stage (0.bias is "
        "2.bias: parts 0 and 2, both on stage 0 with balance [1, 1, 1, 2])" in message
    )
    assert "in one part or on different stages" in message and "data_parallel='replicate'" in message
    for balance, stages in (([3, 2], 2), ([5], 1)):  # across stages; one stage, one part
        sharding.check_ties(Net("tied").layers, "fsdp", balance, stages)
    sharding.check_ties(TiedBiases().layers, "fsdp", [3, 2], 2)  # one part of stage 0
    sharding.check_ties(TiedBiases().layers, "replicate", [1, 1, 1, 2], 2)  # replicate: no refusal


def test_parameters_outside_named_sequential_are_listed():
    message = _fit_before_spawn(OutsideParams(), module_name="layers")
    assert "parameters outside the pipelined nn.Sequential 'layers': scale" in message


def test_ambiguous_or_missing_sequential_says_to_pass_module_name():
    message = _fit_before_spawn(TwoSequentials())
    assert "module_name" in message
    message = _fit_before_spawn(Net("mlp"), module_name="nope")
    assert "module_name='nope' does not name a submodule" in message


def test_a_plan_that_does_not_fit_the_model_is_refused_before_spawn():
    """plan= (issue 39): a name that is not a part, or parameters the plan leaves out, before any process."""
    message = _fit_before_spawn(GPT(), plan=["embed", "blocks", "norm", "lm_head"])
    assert (
        "'lm_head', which is not a submodule of GPT; its submodules are: embed, blocks, norm, head" in message
    )
    message = _fit_before_spawn(GPT(tied=False), plan=["blocks", "norm", "head"])
    assert "outside plan=['blocks', 'norm', 'head']: embed.tok.weight, embed.pos.weight" in message
    with pytest.raises(ValueError, match=r"lists 'norm' more than once"):
        GPipeStrategy(plan=["embed", "blocks", "norm", "norm", "head"])


def test_more_stages_than_layers_raise_before_spawn():
    message = _fit_before_spawn(Net("mlp"), devices=6)
    assert "more pipeline stages than layers (stages: 6, layers: 5)" in message


@pytest.mark.parametrize(
    ("v", "fix"), [(3, "virtual_stages=2"), (None, "schedule='1f1b' (one part per stage)")]
)
def test_more_parts_than_layers_name_the_virtual_stages_that_fit_before_spawn(v, fix):
    """Interleaving cuts K·v parts: the message counts the parts, not the processes, and names the fix."""
    mlp = Net("mlp")  # 5 layers
    mlp.layers = mlp.layers[:3] if v is None else mlp.layers  # 3 layers: 2 × 2 parts do not fit
    message = _fit_before_spawn(mlp, schedule="interleaved_1f1b", virtual_stages=v)
    parts = "2 × 2 = 4 parts" if v is None else "2 × 3 = 6 parts"
    assert f"stages × virtual stages = {parts} of one layer or more, and it has" in message
    assert f"; use {fix}, or a deeper nn.Sequential" in message


def test_balance_sum_mismatch_raises_before_spawn():
    message = _fit_before_spawn(Net("mlp"), balance=[2, 2])
    assert (
        "balance=[2, 2] places 4 layers but the nn.Sequential has 5: give layers per stage that add up"
        in message
    )
    assert "to 5, e.g. balance=[3, 2], or a balancer" in message


def test_a_balance_that_does_not_cover_a_plans_chain_names_the_chain_before_spawn():
    message = _fit_before_spawn(GPT(tied=False), plan=["embed", "blocks", "norm", "head"], balance=[3, 3])
    assert (
        "balance=[3, 3] places 6 layers but the plan's chain embed → blocks[0..3] → norm → head (a "
        "ModuleList's items one layer each) has 7" in message
    )


def test_balance_length_must_match_stages():
    message = _fit_before_spawn(Net("mlp"), devices=2, balance=[1, 1, 3])
    assert "balance has 3 stages but the pipeline has 2" in message


def test_sync_batchnorm_is_refused_at_trainer_construction():
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) is not supported.*deferred_batch_norm=True"):
        pl.Trainer(strategy=GPipeStrategy(), devices=2, sync_batchnorm=True, **trainer_kwargs(1))


class Manual(Net):
    def __init__(self):
        super().__init__("mlp")
        self.automatic_optimization = False


def test_tensor_parallel_without_a_plan_is_refused_before_spawn():
    """T > 1 needs the module's parallelize_stage hook (issue 42, item 3): refused at fit, no process started,
    the message naming the size, the hook and the plan to write; a module with the hook passes the check."""
    trainer = pl.Trainer(strategy=GPipeStrategy(tensor_parallel_size=2), devices=4, **trainer_kwargs(1))
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 needs a tensor-parallel plan: Net has no "
        r"parallelize_stage\(self, stage, tp_mesh\) method.*parallelize_module.*ColwiseParallel.*"
        r"RowwiseParallel.*or set tensor_parallel_size=1",
    ):
        trainer.fit(Net("mlp"), make_data("mlp", 10, 1))
    assert trainer.strategy.launcher.procs == []
    trainer.strategy.check_model(Llama())  # has the hook: cut as usual


class OneArgumentPlan(Llama):
    def parallelize_stage(self, stage):
        """A plan hook with the mesh argument forgotten (refused before any process starts)."""


def test_a_parallelize_stage_that_cannot_take_stage_and_mesh_is_refused_before_spawn():
    trainer = pl.Trainer(strategy=GPipeStrategy(tensor_parallel_size=2), devices=4, **trainer_kwargs(1))
    with pytest.raises(
        ValueError,
        match=r"OneArgumentPlan.parallelize_stage\(stage\) cannot be called as parallelize_stage\(stage, "
        r"tp_mesh\).*def parallelize_stage\(self, stage, tp_mesh\)",
    ):
        trainer.fit(OneArgumentPlan(), make_data("mlp", 10, 1))
    assert trainer.strategy.launcher.procs == []


def test_manual_optimization_is_refused_before_spawn():
    trainer = pl.Trainer(strategy=GPipeStrategy(), devices=2, **trainer_kwargs(1))
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(Manual(), make_data("mlp", 10, 1))
    assert trainer.strategy.launcher.procs == []


def test_manual_optimization_under_1f1b_is_refused_before_spawn():
    trainer = pl.Trainer(strategy=GPipeStrategy(schedule="1f1b"), devices=2, **trainer_kwargs(1))
    with pytest.raises(ValueError, match=r"manual optimization .* which schedule='1f1b' does not support"):
        trainer.fit(Manual(), make_data("mlp", 10, 1))
    assert trainer.strategy.launcher.procs == []


def test_a_buffer_shared_across_stages_is_refused_before_spawn():
    """Tied parameters train across stages (tests/distributed/partition/test_tied.py); a shared buffer
    cannot stay exact."""

    class Tied(pl.LightningModule):
        def __init__(self):
            super().__init__()
            bn = nn.BatchNorm1d(6)
            self.layers = nn.Sequential(bn, nn.Tanh(), bn, nn.Tanh(), nn.Linear(6, 3))

    message = _fit_before_spawn(Tied(), balance=[2, 3])
    assert "the buffer '0.running_mean' is shared by layers on stages [0, 1]" in message
    assert "keep the layers sharing it on one stage" in message


def test_iterating_the_pipelined_sequential_in_a_step_raises_the_one_call_error():
    """``for layer in self.layers:`` inside a step would run only this stage's layers (a raw shape error
    on the next stage); it raises PipelineUsageError, as calling the Sequential twice does."""
    from lightning_gpipe.engine.stage import PipelineStage, PipelineUsageError
    from lightning_gpipe.transport.layout import StageTopology
    from lightning_gpipe.transport.p2p import P2P

    layers = [("0", nn.Linear(6, 16)), ("1", nn.Tanh())]
    stage = PipelineStage(
        layers, StageTopology(0, 2, None, 1), 2, "never", P2P(torch.device("cpu")), ["0", "1", "2"]
    )
    assert [type(m) for m in stage] == [nn.Linear, nn.Tanh]  # outside a step: its layers
    stage.begin_step(expect_backward=True)
    with pytest.raises(PipelineUsageError, match=r"iterated inside a step .*call the Sequential once"):
        for _layer in stage:
            pass
    stage.end_step()


def test_checkpoint_format_names_the_value_and_both_choices():
    with pytest.raises(ValueError, match=r"checkpoint_format='zip' is not one of 'full' \(.*\) or 'sharded'"):
        GPipeStrategy(checkpoint_format="zip")
