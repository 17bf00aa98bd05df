"""Behaviour of the recipe models and LightningModules (single process, CPU)."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from recipes.models.amoebanet import build_amoebanet
from recipes.models.transformer import build_transformer
from recipes.modules import ImageClassifier, LanguageModel, warmup_cosine

torch.set_num_threads(1)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- Transformer ---------------------------------------------------------------------------


def test_transformer_is_flat_sequence_of_layers():
    model = build_transformer(vocab_size=50, num_layers=3, d_model=32, num_heads=4, d_ff=64, seq_len=16)
    assert isinstance(model, nn.Sequential)
    assert len(model) == 3 + 3  # embedding, blocks, final norm, head
    x = torch.randint(0, 50, (2, 16))
    h = x
    for layer in model:
        h = layer(h)
        assert isinstance(h, torch.Tensor)
    assert h.shape == (2, 16, 50)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, model(x))


def test_transformer_shorter_sequences():
    model = build_transformer(vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=16)
    assert model(torch.randint(0, 50, (3, 5))).shape == (3, 5, 50)


def test_changing_a_future_token_leaves_past_logits_unchanged():
    torch.manual_seed(0)
    model = build_transformer(
        vocab_size=30, num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=12
    ).eval()
    x = torch.randint(0, 30, (2, 12))
    changed = x.clone()
    changed[:, 7] = (x[:, 7] + 1) % 30
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_transformer_rejects_too_long_sequence_and_bad_heads():
    model = build_transformer(vocab_size=10, num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=8)
    with pytest.raises(ValueError, match="seq_len: 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="num_heads: 3"):
        build_transformer(vocab_size=10, num_layers=1, d_model=16, num_heads=3, d_ff=32, seq_len=8)


def test_transformer_l_sizes_are_expressible():
    # GPipe's Transformer-L: d_model 2048, d_ff 8192, 32 heads (arXiv 1811.06965).
    vocab, layers, d, ff, t = 32000, 2, 2048, 8192, 256
    with torch.device("meta"):
        model = build_transformer(vocab, layers, d, 32, ff, t, 0.1)
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * (2 * d)
    expected = vocab * d + t * d + layers * block + 2 * d + d * vocab + vocab
    assert num_parameters(model) == expected


# --- AmoebaNet-D ---------------------------------------------------------------------------


def test_amoebanet_layers_pass_tuples_of_float_tensors():
    model = build_amoebanet(num_classes=7, num_layers=6, num_filters=16, in_channels=1).eval()
    assert len(model) == 6 + 6
    h = torch.randn(2, 1, 32, 32)
    sizes = []
    for layer in list(model)[:-1]:
        h = layer(h)
        assert isinstance(h, tuple) and len(h) == 2
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in h)
        sizes.append(h[0].shape[-1])
    assert sizes == [16, 8, 4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert model[-1](h).shape == (2, 7)


def test_amoebanet_parameter_count_matches_hand_count():
    # Counted from the AmoebaNet-D cell definition for (L, D) = (3, 16), 10 classes, RGB:
    # convolutions have no bias, a batch norm has 2 parameters per channel.
    def rcb(cin, cout):  # ReLU, 1x1 conv, BN
        return cin * cout + 2 * cout

    def factorized_reduce(cin, cout):  # two 1x1 convs to cout/2 each, BN
        return 2 * cin * (cout // 2) + 2 * cout

    def conv_1x1(c):
        return c * c + 2 * c

    def conv_3x3(c):  # 1x1 to c/4, 3x3, 1x1 back to c; BN after each
        b = c // 4
        return (c * b + 2 * b) + (9 * b * b + 2 * b) + (b * c + 2 * c)

    def conv_1x7_7x1(c):  # 1x1 to c/4, 1x7, 7x1, 1x1 back to c; BN after each
        b = c // 4
        return (c * b + 2 * b) + 2 * (7 * b * b + 2 * b) + (b * c + 2 * c)

    def normal(c):  # three 1x1 and two 1x7/7x1 ops; pools and identities are free
        return 3 * conv_1x1(c) + 2 * conv_1x7_7x1(c)

    def reduction(c):  # one each of 3x3, 1x7/7x1, 1x1 (the 'none' ops see stride 1 states)
        return conv_3x3(c) + conv_1x7_7x1(c) + conv_1x1(c)

    expected = (
        (3 * 4 * 9 + 2 * 4)  # stem: 3x3 conv 3 -> D/4 = 4, BN
        + rcb(4, 8) + rcb(4, 8) + reduction(8)  # stem reduction 1, out 3*8 = 24
        + rcb(24, 16) + factorized_reduce(4, 16) + reduction(16)  # stem reduction 2, out 48
        + rcb(48, 16) + factorized_reduce(24, 16) + normal(16)  # normal, out 4*16 = 64
        + rcb(64, 32) + rcb(48, 32) + reduction(32)  # reduction, out 96
        + rcb(96, 32) + factorized_reduce(64, 32) + normal(32)  # normal, out 128
        + rcb(128, 64) + rcb(96, 64) + reduction(64)  # reduction, out 192
        + rcb(192, 64) + factorized_reduce(128, 64) + normal(64)  # normal, out 256
        + (256 * 10 + 10)  # classifier
    )  # fmt: skip
    assert num_parameters(build_amoebanet(num_classes=10, num_layers=3, num_filters=16)) == expected


def test_amoebanet_gpipe_size_matches_paper():
    # GPipe Table 1: AmoebaNet-D (18, 208) has 82M parameters (ImageNet, 1000 classes).
    with torch.device("meta"):
        model = build_amoebanet(num_classes=1000, num_layers=18, num_filters=208)
    assert num_parameters(model) / 1e6 == pytest.approx(82, rel=0.01)


def test_amoebanet_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_layers: 4"):
        build_amoebanet(num_layers=4)
    with pytest.raises(ValueError, match="num_filters: 20"):
        build_amoebanet(num_filters=20)


# --- LightningModules ----------------------------------------------------------------------


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 110) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 110) == pytest.approx(1.0)
    assert warmup_cosine(60, 10, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert warmup_cosine(500, 10, 110) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "module",
    [
        lambda: LanguageModel(num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=8),
        lambda: ImageClassifier(num_layers=3, num_filters=16, in_channels=1),
    ],
    ids=["language_model", "image_classifier"],
)
def test_all_parameters_live_in_layers(module):
    model = module()
    assert {id(p) for p in model.parameters()} == {id(p) for p in model.layers.parameters()}
    assert isinstance(model.layers, nn.Sequential)


class _CountCalls:
    def __init__(self, model: LanguageModel | ImageClassifier) -> None:
        self.calls = 0
        model.layers.register_forward_hook(self.hook)

    def hook(self, *args) -> None:
        self.calls += 1


def _fit_one_step(model: pl.LightningModule, batch) -> pl.Trainer:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=len(batch[0]))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        fast_dev_run=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, loader)
    return trainer


def test_language_model_step_logs_loss_and_perplexity():
    torch.manual_seed(0)
    model = LanguageModel(num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=8)
    counter = _CountCalls(model)
    x = torch.randint(0, 256, (4, 8))
    trainer = _fit_one_step(model, (x, x.roll(-1, 1)))
    assert counter.calls == 2  # one training and one validation step, each calling layers once
    metrics = trainer.callback_metrics
    assert {"train_loss", "train_ppl", "val_loss", "val_ppl"} <= set(metrics)
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-4)
    assert float(metrics["val_loss"]) == pytest.approx(math.log(256), rel=0.05)


def test_image_classifier_step_logs_loss_and_accuracy():
    torch.manual_seed(0)
    model = ImageClassifier(num_layers=3, num_filters=16, in_channels=1, optimizer="sgd", lr=0.01)
    counter = _CountCalls(model)
    trainer = _fit_one_step(model, (torch.randn(4, 1, 32, 32), torch.tensor([0, 1, 2, 3])))
    assert counter.calls == 2
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_acc"} <= set(metrics)
    assert 0.0 <= float(metrics["val_acc"]) <= 1.0
