"""PipelineStage's module face: indexing by the whole Sequential's indices.

The schedule it runs is tested in ``tests/unit/engine/test_executor.py``.
"""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.stage import PipelineStage, PipelineUsageError
from lightning_gpipe.transport.layout import StageTopology
from lightning_gpipe.transport.p2p import P2P


def test_indexing_a_stage_uses_the_whole_sequentials_indices():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3), nn.ReLU())
    stage = PipelineStage(
        list(seq.named_children())[2:],
        StageTopology(1, 2, 0, None),
        1,
        "never",
        P2P(torch.device("cpu")),
        list(seq._modules),
    )
    assert stage[2] is seq[2] and stage[-1] is seq[3]
    with pytest.raises(
        PipelineUsageError, match="layer 0 of the pipelined nn.Sequential lives on another stage"
    ):
        stage[0]
    with pytest.raises(PipelineUsageError, match="slicing"):
        stage[1:]


def test_a_layer_on_another_stage_points_a_freeze_to_a_loop_over_the_stage():
    seq = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8))
    stage = PipelineStage(
        list(seq.named_children())[2:],
        StageTopology(1, 2, 0, None),
        1,
        "never",
        P2P(torch.device("cpu")),
        list(seq._modules),
    )
    with pytest.raises(PipelineUsageError, match=r"freeze layers .*loop over self.layers"):
        stage[1].eval()  # one-device code freezing the BatchNorm of stage 0, run on stage 1
    for m in stage:  # the loop the message names freezes this stage's BatchNorm, and only it
        if isinstance(m, nn.BatchNorm1d):
            m.eval()
    assert [m.training for m in seq] == [True, True, True, False]


def test_indexing_a_stage_of_a_sequential_with_named_layers():
    seq = nn.Sequential(OrderedDict([("inp", nn.Linear(4, 8)), ("act", nn.Tanh()), ("out", nn.Linear(8, 1))]))
    stage = PipelineStage(
        list(seq.named_children())[1:],
        StageTopology(1, 2, 0, None),
        1,
        "never",
        P2P(torch.device("cpu")),
        list(seq._modules),
    )
    assert stage[-1] is seq.out and stage[1] is seq.act


def test_a_call_outside_a_step_names_where_the_model_can_run_instead():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3))
    stage = PipelineStage(
        list(seq.named_children())[:2],
        StageTopology(0, 2, None, 1),
        1,
        "never",
        P2P(torch.device("cpu")),
        list(seq._modules),
    )
    with pytest.raises(
        PipelineUsageError, match="called outside training/validation/test/predict_step"
    ) as err:
        stage(torch.zeros(1, 2))  # as a callback's pl_module(x) in on_train_epoch_end would
    for way in ("validation_step or predict_step", "trainer.predict(model, dataloaders)", "on_fit_end"):
        assert way in str(err.value)
