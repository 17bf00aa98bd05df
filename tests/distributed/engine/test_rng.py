"""Random layers under the pipeline: each stage draws its masks per micro-batch from its own stream, seeded from
rank 0's generator and the stage's index (README, "Every rank starts from rank 0's random state"; CPU, Gloo, hard timeouts)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_gpipe.engine.microbatch import sizes
from tests.conftest import max_diff
from tests.models import Net, make_data, pl, train_single_device, trainer_kwargs

BALANCE = [3, 3]  # "dropout": [Linear, Dropout(0.5), Tanh] | [Linear, Dropout(0.3), Linear]


class PerStageGenerators(Net):
    """One device, no pipeline library: the README's claim written out.

    One CPU generator per stage k, seeded ``base + k`` with ``base`` drawn (and put back) from the global
    generator at the first ``training_step`` (after the seed, the module's initialisation and the
    loader's draws). Each step,
    stage by stage: restore the stage's state, run the stage's layers on each micro-batch in order
    (stage k + 1 takes stage k's output of that micro-batch), keep the state the draws leave. The loss
    is the mean loss over the batch, ``Σ_i (n_i / N) · loss_i``; Lightning does the one backward and the
    optimizer step (``Net``'s SGD).
    """

    def __init__(self, chunks: int, **kwargs) -> None:
        super().__init__("dropout", **kwargs)
        self.chunks = chunks
        self.stage_rng: list[torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.stage_rng is None:  # stage k's stream: seeded base + k, base drawn and put back
            with torch.random.fork_rng():
                base = int(torch.randint(2**62, (1,)))
            self.stage_rng = [
                torch.Generator().manual_seed(base + k).get_state() for k in range(len(BALANCE))
            ]
        n = sizes(len(x), self.chunks)
        hs, ys = list(x.split(n)), y.split(n)
        start = 0
        for k, count in enumerate(BALANCE):
            stage = self.layers[start : start + count]
            start += count
            torch.set_rng_state(self.stage_rng[k])
            hs = [stage(h) for h in hs]
            self.stage_rng[k] = torch.get_rng_state()
        loss = sum(len(h) / len(x) * F.mse_loss(h, yi) for h, yi in zip(hs, ys, strict=True))
        self.losses.append(loss.item())
        return loss


def _emulate(chunks: int, steps: int) -> PerStageGenerators:
    """The worker's script on one device (seed 0, Net's init, Trainer, unshuffled loader) with the emulation."""
    pl.seed_everything(0, verbose=False)
    model = PerStageGenerators(chunks, lr=0.1)
    trainer = pl.Trainer(devices=1, **trainer_kwargs(steps))
    trainer.fit(model, make_data("dropout", 10, 5))
    return model


@pytest.mark.timeout(120)
def test_dropout_masks_equal_one_device_running_each_stage_on_the_micro_batches(gpipe_job):
    """Dropout on both stages of 2, recompute "except_last", 3 steps of batch 10 (seeded, unshuffled), chunks 2
    ([5, 5]) and chunks 3 ([4, 3, 3]): the pipeline's losses and final weights equal (≤ 1e-5) one device
    keeping one generator per stage, all starting from the state of the first step, each drawing its stage's
    masks micro-batch by micro-batch; and differ (> 1e-3) from one device drawing the whole batch's masks
    through the whole model from one generator (so the test sees the masks)."""
    steps = 3
    runs = [{"chunks": c, "balance": BALANCE, "checkpoint": "except_last"} for c in (2, 3)]
    results, _ = gpipe_job("dropout", 2, runs, timeout=90, steps=steps)
    plain = train_single_device("dropout", 0, steps=steps)
    for r, chunks in zip(results, (2, 3), strict=True):
        expected = _emulate(chunks, steps)
        assert len(r["losses"]) == len(expected.losses) == steps
        assert max(abs(a - b) for a, b in zip(r["losses"], expected.losses)) <= 1e-5, (
            chunks,
            r["losses"],
            expected.losses,
        )
        assert max_diff(r["state"], expected.state_dict()) <= 1e-5, chunks
        # the masks matter: one generator over the whole batch and model trains a different model
        assert max_diff(r["state"], plain.state_dict()) > 1e-3, chunks
        assert max(abs(a - b) for a, b in zip(r["losses"], plain.losses)) > 1e-3, chunks


@pytest.mark.timeout(120)
def test_random_layers_on_one_stage_leave_every_stage_the_same_batches_every_epoch(gpipe_job):
    """Both dropouts on stage 0 of 2 ([5, 1]), a shuffling loader over 3 epochs of 2 steps: the first stage
    draws its masks, the last none, yet every stage draws the same permutation in every epoch (the loader
    draws each epoch's seed from the global generator, which the stages' layers leave alone:
    ``lightning_gpipe.engine.rng``), and the global generators agree at the end. Before, the ranks parted
    from the second epoch: the inputs of one permutation trained against the targets of another."""
    results, _ = gpipe_job(
        "dropout",
        2,
        [{"chunks": 2, "balance": [5, 1]}],
        timeout=90,
        steps=-1,
        samples=20,
        shuffle=True,
        trainer={"max_epochs": 3, "max_steps": -1},
        net={"indexed": True},
    )
    ranks = results[0]["ranks"]
    epochs = [ranks[0]["indices"][2 * e : 2 * e + 2] for e in range(3)]
    assert len({str(e) for e in epochs}) == 3  # shuffled: each epoch its own order
    for rank in ranks[1:]:
        assert rank["indices"] == ranks[0]["indices"]
        assert torch.equal(rank["rng_after"], ranks[0]["rng_after"])


@pytest.mark.timeout(120)
def test_draws_after_the_pipelined_call_reach_every_stage_with_the_step_outcome(gpipe_job):
    """``training_step`` draws from torch's generator after the pipelined call (code only the last stage
    runs); with a shuffling loader over 3 epochs every stage still draws one device's permutation in every
    epoch and ends with one device's generator state: the last stage's generator state travels with the
    step outcome (``lightning_gpipe.engine.outcome``)."""
    extra = {"max_epochs": 3, "max_steps": -1}
    net = {"indexed": True, "draw_after_call": True}
    reference = train_single_device(
        "mlp", 0, steps=-1, trainer_extra=extra, data={"shuffle": True, "samples": 20}, **net
    )
    results, _ = gpipe_job(
        "mlp", 2, [{"chunks": 2}], timeout=90, steps=-1, samples=20, shuffle=True, trainer=extra, net=net
    )
    assert len(reference.indices) == 6
    for rank in results[0]["ranks"]:
        assert rank["indices"] == reference.indices
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference.losses)) <= 1e-5
    assert max_diff(results[0]["state"], reference.state_dict()) <= 1e-5


@pytest.mark.timeout(120)
def test_per_micro_batch_calls_draw_the_same_numbers_before_the_call_on_every_stage(gpipe_job):
    """Under 1F1B ``training_step`` runs once per micro-batch; it draws before the pipelined call (a random
    mask every stage must agree on: the first stage's input, the last stage's loss) and after it (last stage
    only). Every stage draws the same numbers before the call in every call of every step: the last
    stage's code after the call draws from its own stream (``lightning_gpipe.engine.rng``)."""
    net = {"draw_before_call": True, "draw_after_call": True}
    results, _ = gpipe_job("mlp", 2, [{"chunks": 4, "schedule": "1f1b"}], timeout=90, steps=3, net=net)
    ranks = results[0]["ranks"]
    assert len(ranks[0]["pre_draws"]) == 12  # 3 steps of 4 calls
    assert len({str(d) for d in ranks[0]["pre_draws"]}) == 12
    for rank in ranks[1:]:
        assert rank["pre_draws"] == ranks[0]["pre_draws"]
