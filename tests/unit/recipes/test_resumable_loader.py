"""The recipes' training loader: ``shuffle=True``'s order, and a mid-epoch state that resumes exactly.

Each pass is driven as Lightning's training loop drives a loader with a length: ``iter`` at the
start of an epoch, then one batch per step, with ``state_dict`` taken at a step boundary. A
``torch.rand`` per step stands for whatever else draws from torch's global generator (dropout).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recipes.data.recorded_shuffle import RecordedShuffle
from recipes.data.resumable_loader import ResumableLoader

N, B = 40, 4  # 10 batches a pass


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(N))


def _loader(**kwargs) -> ResumableLoader:
    data = _data()
    return ResumableLoader(data, batch_size=B, sampler=RecordedShuffle(data), drop_last=True, **kwargs)


def _train(loader, epochs: int, start_epoch: int = 0, stop: tuple[int, int] | None = None):
    """The batches (as lists) and per-step draws of ``epochs`` passes; with ``stop=(epoch, step)``,
    also the state taken after that many steps of that epoch, where the run then ends."""
    seen, draws = [], []
    for epoch in range(start_epoch, start_epoch + epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for step, (batch,) in enumerate(loader, start=1):
            seen.append(batch.tolist())
            draws.append(torch.rand(()).item())
            if stop == (epoch, step):
                return seen, draws, loader.state_dict()
    return seen, draws, None


def test_fresh_passes_take_the_order_of_shuffle_true():
    torch.manual_seed(3)
    ours, _, _ = _train(_loader(), epochs=2)
    torch.manual_seed(3)
    plain, _, _ = _train(DataLoader(_data(), batch_size=B, shuffle=True, drop_last=True), epochs=2)
    assert ours == plain and len(ours) == 20


@pytest.mark.parametrize("stop", [(0, 3), (1, 7), (0, 10)], ids=["epoch0-step3", "epoch1-step7", "epoch-end"])
def test_a_state_taken_mid_run_resumes_the_uninterrupted_batches_and_draws(stop):
    epochs = 3
    torch.manual_seed(0)
    whole, whole_draws, _ = _train(_loader(), epochs)
    torch.manual_seed(0)
    first, first_draws, state = _train(_loader(), epochs, stop=stop)
    assert state is not None and state["batches"] == stop[1]
    torch.manual_seed(123)  # a new process: the model's initialisation drew something else
    torch.rand(7)
    resumed = _loader()
    resumed.load_state_dict(state)
    epoch = stop[0] + (stop[1] == N // B)  # Lightning starts the next epoch after a pass's end
    rest, rest_draws, _ = _train(resumed, epochs - epoch, start_epoch=epoch)
    assert first + rest == whole
    assert first_draws + rest_draws == whole_draws


def test_a_resumed_pass_loads_no_sample_of_the_skipped_batches():
    loaded = []

    class Recording(TensorDataset):
        def __getitem__(self, index):
            loaded.append(index)
            return super().__getitem__(index)

    data = Recording(torch.arange(N))
    loader = ResumableLoader(data, batch_size=B, sampler=RecordedShuffle(data), drop_last=True)
    torch.manual_seed(0)
    iterator = iter(loader)
    taken = [next(iterator)[0].tolist() for _ in range(6)]
    state = loader.state_dict()
    loaded.clear()
    resumed = ResumableLoader(data, batch_size=B, sampler=RecordedShuffle(data), drop_last=True)
    resumed.load_state_dict(state)
    rest = [batch.tolist() for (batch,) in resumed]
    assert len(rest) == 4 and sorted(loaded) == sorted(i for batch in rest for i in batch)
    assert not {i for batch in taken for i in batch} & set(loaded)


def test_a_distributed_sampler_resumes_its_epoch():
    def loader():
        data = _data()
        return ResumableLoader(
            data, batch_size=B, drop_last=True, sampler=DistributedSampler(data, 2, 1, seed=5)
        )

    whole, _, _ = _train(loader(), epochs=2)
    first, _, state = _train(loader(), epochs=2, stop=(1, 2))
    assert state is not None and state["epoch"] == 1
    resumed = loader()
    resumed.load_state_dict(state)  # its iterator is made before Lightning sets the epoch again
    rest = [batch.tolist() for (batch,) in resumed]
    assert first + rest == whole


def test_a_state_of_a_longer_pass_is_refused_naming_the_counts():
    state = {"batches": 11, "seed": 1, "epoch": None, "rng": torch.get_rng_state()}
    with pytest.raises(ValueError, match=r"11 batches taken from a pass of 10"):
        _loader().load_state_dict(state)


def test_persistent_workers_take_whole_passes_after_a_resumed_one():
    workers = dict(num_workers=1, persistent_workers=True)  # later passes draw no worker seed
    torch.manual_seed(0)
    whole, _, _ = _train(_loader(**workers), epochs=2)
    torch.manual_seed(0)
    first, _, state = _train(_loader(**workers), epochs=2, stop=(0, 4))
    resumed = _loader(**workers)
    resumed.load_state_dict(state)
    rest, _, _ = _train(resumed, epochs=2)
    assert first + rest == whole


def test_a_loaded_loader_still_counts_a_whole_pass():
    torch.manual_seed(0)
    _, _, state = _train(_loader(), epochs=1, stop=(0, 3))
    resumed = _loader()
    resumed.load_state_dict(state)
    assert len(resumed) == N // B  # what Lightning counts an epoch's batches by
    assert len(list(resumed)) == N // B - 3 and len(resumed) == N // B
