"""Behaviour of the recipe data modules (no downloads, small files written by the tests)."""

from __future__ import annotations

import collections
import math
import pickle
import tarfile

import numpy as np
import pytest
import torch

from recipes.data.cifar10 import CIFAR10DataModule, read_cifar10
from recipes.data.digits import DigitsDataModule
from recipes.data.sft import ByteSFTDataModule, PaddedWindows
from recipes.data.text import ByteTextDataModule, ByteWindows, stdlib_corpus, unigram_entropy

# --- text ----------------------------------------------------------------------------------


def test_stdlib_corpus_is_non_empty_bytes_capped_by_max_bytes():
    corpus = stdlib_corpus(50_000)
    assert len(corpus) == 50_000
    values = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    assert int(values.max()) < 256
    assert b"def " in corpus


def test_text_split_is_deterministic_and_ordered():
    first = ByteTextDataModule(seq_len=16, max_bytes=20_000, val_fraction=0.1)
    second = ByteTextDataModule(seq_len=16, max_bytes=20_000, val_fraction=0.1)
    first.setup()
    second.setup()
    assert torch.equal(first.train_data, second.train_data)
    assert torch.equal(first.val_data, second.val_data)
    assert len(first.val_data) == 2_000 and len(first.train_data) == 18_000
    corpus = stdlib_corpus(20_000)
    assert bytes(first.val_data.tolist()) == corpus[-2_000:]


def test_text_windows_are_next_byte_targets():
    module = ByteTextDataModule(seq_len=16, batch_size=4, max_bytes=20_000)
    x, y = next(iter(module.val_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0
    assert len(module.train_dataset()) == (18_000 - 17) // 16 + 1


def test_byte_windows_cover_data_without_running_past_the_end():
    data = torch.arange(10, dtype=torch.uint8)
    windows = ByteWindows(data, seq_len=3)
    assert len(windows) == 3
    x, y = windows[2]
    assert x.tolist() == [6, 7, 8] and y.tolist() == [7, 8, 9]
    with pytest.raises(IndexError):
        windows[3]


def test_unigram_entropy_in_nats():
    assert unigram_entropy(torch.tensor([7, 7, 7], dtype=torch.uint8)) == 0.0
    assert unigram_entropy(torch.arange(256)) == pytest.approx(math.log(256))
    module = ByteTextDataModule(max_bytes=20_000)
    assert 1.0 < module.val_unigram_entropy < math.log(256)


def test_text_file_path_is_used(tmp_path):
    file = tmp_path / "corpus.txt"
    file.write_bytes(b"abcdefghij" * 100)
    module = ByteTextDataModule(seq_len=8, path=str(file), val_fraction=0.1)
    module.setup()
    assert bytes(module.val_data.tolist()) == (b"abcdefghij" * 10)
    assert module.val_unigram_entropy == pytest.approx(math.log(10))


def test_missing_text_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        ByteTextDataModule(path=str(missing)).setup()


# --- digits --------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["right", "left", "both"])
def test_padded_windows_keep_a_prefix_of_each_window_and_mask_the_rest(padding):
    windows = ByteWindows(torch.arange(200, dtype=torch.uint8), seq_len=10)
    padded = PaddedWindows(windows, min_len=3, padding=padding, pad_id=7)
    lengths = set()
    for i in range(len(windows)):
        ids, targets = windows[i]
        x, labels = padded[i]
        mask = x["attention_mask"]
        keep = int(mask.sum())
        lengths.add(keep)
        assert 3 <= keep <= 10
        left = padding == "left" or (padding == "both" and i % 2 == 1)
        real = torch.arange(10) >= 10 - keep if left else torch.arange(10) < keep
        assert torch.equal(mask.bool(), real)  # one block of real tokens, at the chosen end
        assert torch.equal(x["input_ids"][real], ids[:keep]) and torch.equal(labels[real], targets[:keep])
        assert (x["input_ids"][~real] == 7).all() and (labels[~real] == -100).all()
    assert len(lengths) > 3  # the lengths vary


def test_sft_data_module_batches_dicts_with_masks_and_refuses_a_bad_padding(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefgh" * 400)
    data = ByteSFTDataModule(seq_len=16, batch_size=8, path=str(path), min_len=4)
    x, labels = next(iter(data.train_dataloader()))
    assert x["input_ids"].shape == x["attention_mask"].shape == labels.shape == (8, 16)
    assert torch.equal(labels == -100, x["attention_mask"] == 0)
    bad = r"padding must be one of \['right', 'left', 'both'\] \(padding: 'middle'\)"
    with pytest.raises(ValueError, match=bad):
        ByteSFTDataModule(padding="middle")
    with pytest.raises(ValueError, match=r"min_len must be in \[1, seq_len\] \(min_len: 0, seq_len: 16\)"):
        ByteSFTDataModule(seq_len=16, path=str(path), min_len=0).train_dataset()


def test_digits_split_covers_all_1797_images_deterministically():
    first = DigitsDataModule(resolution=16, channels=3, val_fraction=0.2, seed=1)
    second = DigitsDataModule(resolution=16, channels=3, val_fraction=0.2, seed=1)
    first.setup()
    second.setup()
    assert len(first.train_set) + len(first.val_set) == 1797
    assert len(first.val_set) == round(1797 * 0.2)
    for a, b in zip(
        first.train_set.tensors + first.val_set.tensors, second.train_set.tensors + second.val_set.tensors
    ):
        assert torch.equal(a, b)
    other = DigitsDataModule(resolution=16, channels=3, val_fraction=0.2, seed=2)
    other.setup()
    assert not torch.equal(first.val_set.tensors[1], other.val_set.tensors[1])


def test_digits_shapes_channels_and_normalisation():
    module = DigitsDataModule(resolution=32, channels=1, batch_size=8)
    x, y = next(iter(module.val_dataloader()))
    assert x.shape == (8, 1, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and int(y.max()) < 10
    train_images = module.train_set.tensors[0]
    assert float(train_images.mean()) == pytest.approx(0.0, abs=1e-4)
    assert float(train_images.std()) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="channels: 2"):
        DigitsDataModule(channels=2)


# --- CIFAR-10 ------------------------------------------------------------------------------


def _write_batch(path, images: np.ndarray, labels: list[int]) -> None:
    entry = {
        b"batch_label": b"test",
        b"labels": labels,
        b"data": images.reshape(len(labels), -1),
        b"filenames": [b"x.png"] * len(labels),
    }
    with open(path, "wb") as handle:
        pickle.dump(entry, handle, protocol=2)


@pytest.fixture
def cifar_dir(tmp_path):
    """A tiny archive in the standard layout: 5 training batches of 2 images, a test batch of 3."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        _write_batch(folder / f"data_batch_{i}", rng.integers(0, 256, (2, 3, 32, 32), np.uint8), [i, i + 1])
    _write_batch(folder / "test_batch", rng.integers(0, 256, (3, 3, 32, 32), np.uint8), [9, 0, 4])
    return folder


def test_cifar_reads_directory_and_archive_alike(cifar_dir, tmp_path):
    archive = tmp_path / "archive" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(cifar_dir, arcname="cifar-10-batches-py")
    reference = read_cifar10(cifar_dir, train=True)
    assert reference[0].shape == (10, 3, 32, 32) and reference[0].dtype == torch.uint8
    assert reference[1].tolist() == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    for root in (cifar_dir, tmp_path, archive, archive.parent, str(archive)):
        for train in (True, False):
            images, labels = read_cifar10(root, train=train)
            expected_images, expected_labels = read_cifar10(cifar_dir, train=train)
            assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert read_cifar10(archive, train=False)[1].tolist() == [9, 0, 4]


def test_cifar_pixels_keep_channel_layout(cifar_dir):
    images = np.zeros((2, 3, 32, 32), np.uint8)
    images[0, 1] = 200  # green plane of the first image
    _write_batch(cifar_dir / "test_batch", images, [1, 2])
    loaded, _ = read_cifar10(cifar_dir, train=False)
    assert int(loaded[0, 1].min()) == 200 and int(loaded[0, 0].max()) == 0


def test_cifar_data_module_batches(cifar_dir):
    module = CIFAR10DataModule(root=str(cifar_dir), batch_size=3, augment=True)
    x, y = next(iter(module.train_dataloader()))
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(module.val_set) == 3


def test_missing_cifar_names_root_and_archive(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        read_cifar10(tmp_path / "nowhere")
    assert "nowhere" in str(error.value) and "cifar-10-python.tar.gz" in str(error.value)
    with pytest.raises(FileNotFoundError, match="empty"):
        CIFAR10DataModule(root=str(tmp_path / "empty")).setup()


def test_cifar_rejects_pickles_with_other_objects(cifar_dir):
    with open(cifar_dir / "test_batch", "wb") as handle:
        pickle.dump(collections.OrderedDict(data=1), handle, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="OrderedDict"):
        read_cifar10(cifar_dir, train=False)
