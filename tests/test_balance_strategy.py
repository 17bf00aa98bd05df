"""balance="parameters" | "time" | "memory" through the strategy: rank 0 profiles, all ranks agree."""

import pytest
import torch
from torch import nn

from tests.conftest import max_diff
from tests.models import train_single_device


@pytest.mark.timeout(300)
def test_balancers_choose_one_balance_for_all_ranks_and_train_like_one_device(gpipe_job, tmp_path):
    reference = train_single_device("mlp", 0, steps=3)
    runs = [{"chunks": 2, "balance": how} for how in ("parameters", "time", "memory")]
    # training_step logs before calling the Sequential: the sample capture must tolerate it
    results, _ = gpipe_job("mlp", 3, runs, steps=3, save="balanced.ckpt", net={"log_first": True})
    for result in results:
        assert max_diff(result["state"], reference.state_dict()) <= 1e-5
    saved = torch.load(tmp_path / "balanced.ckpt", weights_only=False)["gpipe"]
    assert saved["balance_by"] == "memory" and sum(saved["balance"]) == 5 and len(saved["balance"]) == 3
    assert all(n >= 1 for n in saved["balance"])


def test_parameters_balance_isolates_the_big_layer():
    from lightning_gpipe.balance import balance_by_parameters

    seq = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 400), nn.Linear(400, 400), nn.Linear(400, 4), nn.Linear(4, 4)
    )
    assert balance_by_parameters(seq, 3) == [2, 1, 2]


def test_indexing_a_stage_uses_the_whole_sequentials_indices():
    from lightning_gpipe.comm import P2P
    from lightning_gpipe.layout import StageTopology
    from lightning_gpipe.stage import PipelineStage, PipelineUsageError

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


def test_indexing_a_stage_of_a_sequential_with_named_layers():
    from collections import OrderedDict

    from lightning_gpipe.comm import P2P
    from lightning_gpipe.layout import StageTopology
    from lightning_gpipe.stage import PipelineStage

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
