"""Tied weights across stages train like one device (lightning_gpipe.partition.tied).

Every multi-process job runs under a hard timeout (tests/_harness.py kills the whole process group).
"""

import pytest
import torch
from torch import nn

from lightning_gpipe.partition.cut import PartitionError, check_tied_parameters
from lightning_gpipe.partition.tied import Tied, alias_tied_state, canonical_name, find_tied
from tests.models import build_layers


def test_find_tied_names_every_place_and_the_owner():
    seq = build_layers("tied")
    assert find_tied(seq, [3, 2]) == [Tied(("0.weight", "4.weight"), (0, 1), (0, 1))]
    assert find_tied(seq, [5]) == []
    assert canonical_name(find_tied(seq, [2, 2, 1]), 2) == {"4.weight": "0.weight"}
    assert canonical_name(find_tied(seq, [2, 2, 1]), 0) == {"0.weight": None}
    state = alias_tied_state({"0.weight": torch.ones(2), "4.weight": torch.zeros(2)}, find_tied(seq, [3, 2]))
    assert state["4.weight"] is state["0.weight"]


def test_a_buffer_shared_across_stages_is_refused_with_the_reason():
    bn = nn.BatchNorm1d(4)
    seq = nn.Sequential(nn.Linear(4, 4), bn, nn.Tanh(), bn)
    check_tied_parameters(seq, [4])  # one stage: nothing to keep in step
    with pytest.raises(
        PartitionError, match=r"buffer '1.running_mean' is shared by layers on stages \[0, 1\]"
    ):
        check_tied_parameters(seq, [2, 2])
