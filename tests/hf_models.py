"""Tiny transformers models (from configs, never the hub) under a LightningModule whose ``layers``
is the adapter."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.integrations.transformers import causal_lm
from tests.gpt import GPT, gpt_data
from tests.models import trainer_kwargs

VOCAB, LENGTH = 50, 8


def build_hf(family: str):
    """A tiny GPT-2 (tied embedding and head, dropout 0), Llama or Mistral (a sliding window of 3
    over the 8 tokens), seeded; ``"<family>-sft"`` is the same model."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    family = family.removesuffix("-sft")
    torch.manual_seed(0)
    if family == "mistral":
        config = MistralConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16, sliding_window=3,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return MistralForCausalLM(config)
    if family == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class HFCausalLM(pl.LightningModule):
    """``self.layers = causal_lm(model)``; the loss is the model's own LM loss (next-token cross-entropy).

    A batch ``(ids,)`` trains on every token; ``(ids, attention_mask)`` (``"<family>-sft"``, padded
    SFT data) feeds the mask to the pipeline as ``{"input_ids", "attention_mask"}``, ignores padded
    targets, and returns the count of valid targets as ``num_items`` (a token mean, docs/lightning.md).
    """

    def __init__(self, family: str, lr: float = 0.1) -> None:
        super().__init__()
        hf = build_hf(family)
        self.__dict__["hf"] = hf  # not a submodule: every parameter lives in self.layers
        self.layers = causal_lm(hf)
        self.lr = lr
        self.losses: list[float] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        if len(batch) == 2:
            ids, mask = batch
            labels = ids.masked_fill(mask == 0, -100)
            logits = self.layers({"input_ids": ids, "attention_mask": mask})
            loss = self.hf.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)
            self.losses.append(loss.item())
            return {"loss": loss, "num_items": (labels[:, 1:] != -100).sum()}
        (ids,) = batch
        logits = self.layers(ids)
        loss = self.hf.loss_function(logits=logits, labels=ids, vocab_size=VOCAB)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.params.append({n: p.detach().clone() for n, p in self.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def lm_data(batch: int = 10, steps: int = 5) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randint(0, VOCAB, (batch * steps, LENGTH), generator=g)), batch_size=batch
    )


def sft_data(batch: int = 10, steps: int = 5) -> DataLoader:
    """Padded batches: ids ``(N, 8)`` and a mask with 3 to 8 real tokens per row, left-padded on
    even rows and right-padded on odd rows."""
    g = torch.Generator().manual_seed(2)
    n = batch * steps
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
    mask = torch.zeros(n, LENGTH, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        if row % 2:
            mask[row, :length] = 1
        else:
            mask[row, LENGTH - length :] = 1
    return DataLoader(TensorDataset(ids.masked_fill(mask == 0, 0), mask), batch_size=batch)


def reference_lm(family: str, steps: int = 5) -> HFCausalLM:
    """The same module on one device, full batch."""
    pl.seed_everything(0, verbose=False)
    model = HFCausalLM(family)
    pl.Trainer(devices=1, **trainer_kwargs(steps)).fit(model, lm_data(steps=steps))
    return model


def lm_loss_reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed independently of transformers."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def build_image(family: str):
    """A tiny ResNet (BatchNorm) or ViT (dropout 0) image classifier, 10 classes, seeded."""
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    if family == "resnet":
        config = ResNetConfig(
            num_labels=10, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
        )
        return ResNetForImageClassification(config)
    config = ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ViTForImageClassification(config)


IMAGE_SIZE = {"resnet": 32, "vit": 16}


class HFImageClassifier(pl.LightningModule):
    """``self.layers = image_classifier(model)``; cross-entropy on 10 classes."""

    def __init__(self, family: str, lr: float = 0.1) -> None:
        super().__init__()
        from lightning_gpipe.integrations.transformers import image_classifier

        hf = build_image(family)
        self.__dict__["hf"] = hf
        self.layers = image_classifier(hf)
        self.lr = lr
        self.losses: list[float] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layers(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def image_data(family: str, batch: int = 10, steps: int = 5) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    size = IMAGE_SIZE[family]
    x = torch.randn(batch * steps, 3, size, size, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (batch * steps,), generator=g)), batch_size=batch)


def module_and_data(family: str, steps: int = 5):
    if family == "nanogpt":  # pipelined by plan=tests.gpt.PLAN
        return GPT(), gpt_data(steps=steps)
    if family.endswith("-sft"):
        return HFCausalLM(family), sft_data(steps=steps)
    if family in ("gpt2", "llama", "mistral"):
        return HFCausalLM(family), lm_data(steps=steps)
    return HFImageClassifier(family), image_data(family, steps=steps)


def reference(family: str, steps: int = 5, trainer: bool = False):
    """The same module on one device, full batch (and its Trainer, with ``trainer``)."""
    pl.seed_everything(0, verbose=False)
    model, data = module_and_data(family, steps)
    one = pl.Trainer(devices=1, **trainer_kwargs(steps))
    one.fit(model, data)
    return (model, one) if trainer else model


def micro_batch_reference(family: str, chunks: int) -> tuple[HFImageClassifier, list[int]]:
    """One SGD step of the image module on one device as GPipe with ``chunks`` micro-batches and
    deferred BatchNorm computes it, written out without the library: the first batch of
    :func:`image_data` split as ``torch.tensor_split`` splits it, each micro-batch's forward in
    train mode (every BatchNorm normalises by that micro-batch's statistics) and backward of its
    loss weighted by n_i / N, gradients accumulated, one step; then every BatchNorm's running
    statistics set by one momentum update from the inputs it received over all micro-batches,
    concatenated (mean, unbiased variance; ``num_batches_tracked`` + 1), as a deferred BatchNorm
    commits.

    Returns the module after the step and the micro-batch sizes.
    """
    pl.seed_everything(0, verbose=False)
    model, data = module_and_data(family, steps=1)
    x, y = next(iter(data))
    model.train()
    norms = [m for m in model.layers.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    start = {m: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in norms}
    inputs: dict[torch.nn.Module, list[torch.Tensor]] = {m: [] for m in norms}
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs[m].append(args[0].detach())) for m in norms]
    optimizer = model.configure_optimizers()
    optimizer.zero_grad()
    parts = list(zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)))
    for xs, ys in parts:
        (F.cross_entropy(model.layers(xs), ys) * (len(xs) / len(x))).backward()
    optimizer.step()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for m in norms:
            seen = torch.cat(inputs[m]).double()
            mean, var = seen.mean(dim=(0, 2, 3)), seen.var(dim=(0, 2, 3), correction=1)
            running_mean, running_var, tracked = start[m]
            m.running_mean.copy_((1 - m.momentum) * running_mean.double() + m.momentum * mean)
            m.running_var.copy_((1 - m.momentum) * running_var.double() + m.momentum * var)
            m.num_batches_tracked.copy_(tracked + 1)
    return model, [len(xs) for xs, _ in parts]
