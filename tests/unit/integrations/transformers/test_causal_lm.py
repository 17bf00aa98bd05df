"""causal_lm over every causal-LM family with a pipeline plan in the installed transformers: cut
into K stages and run stage by stage on micro-batches as the pipeline runs it, its logits, loss and
gradients equal the model's own forward; or the family is refused by name, as docs/models.md says.

Needs the ``[models]`` extra (transformers).
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers comes with the [models] extra")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from lightning_gpipe.engine.microbatch import scatter, unflatten  # noqa: E402
from lightning_gpipe.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    builtin_plan_families,
    causal_lm,
    plan_families,
    shrink_config,
)
from lightning_gpipe.integrations.transformers.self_check import check_batch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", module="transformers")

DOCS = Path(__file__).resolve().parents[4] / "docs" / "models.md"
PLANS = plan_families()
FAMILIES = sorted(PLANS + builtin_plan_families())  # and those cut by a built-in plan (GPT-2, StableLM, …)


def _documented() -> dict[str, str]:
    """family → "exact" or "refused", from the table of docs/models.md."""
    rows = re.findall(r"^\| `([^`]+)` \| `[^`]+` \| (exact|refused)", DOCS.read_text(), flags=re.M)
    return dict(rows)


def tiny(model_type: str, class_name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = shrink_config(CONFIG_MAPPING[model_type]())
    for name, value in overrides.items():
        setattr(config, name, value)
    return getattr(transformers, class_name)(config)


def stages(seq: torch.nn.Sequential, k: int) -> list[torch.nn.Sequential]:
    """``seq`` cut into ``k`` consecutive near-equal stages."""
    bounds = [round(i * len(seq) / k) for i in range(k + 1)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


def pipelined(seq: torch.nn.Sequential, batch, k: int, chunks: int = 2) -> torch.Tensor:
    """The logits as the pipeline computes them: the batch split by the pipeline's rule, each
    micro-batch through the stages in turn; every tensor between stages must be the micro-batch's."""
    micro, structure = scatter(batch, chunks)
    outs = []
    for tensors in micro:
        x = unflatten(structure, tensors)
        n = x["input_ids"].shape[0] if isinstance(x, dict) else x.shape[0]
        for stage in stages(seq, k):
            x = stage(x)
            leaves = [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
            assert all(t.shape[0] == n for t in leaves), "a tensor between stages lacks the batch dimension"
        outs.append(x)
    return torch.cat(outs)


def labels_of(batch) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)


@pytest.mark.parametrize(("model_type", "class_name"), FAMILIES, ids=[f for f, _ in FAMILIES])
def test_family_is_exact_over_stages_or_refused_by_name(model_type, class_name):
    """K = 2 and 3, two micro-batches, left and right padding, windows of 3 over 8 tokens: logits on
    real tokens, the LM loss and every gradient within 1e-5 of the model's own forward."""
    documented = _documented().get(model_type)
    model = tiny(model_type, class_name)
    try:
        seq = causal_lm(model)
    except UnsupportedModelError as error:
        assert model_type in str(error) and class_name in str(error)
        assert documented == "refused", (
            f"{model_type} is refused ({error}) but docs/models.md says {documented}"
        )
        return
    assert documented == "exact", f"{model_type} is exact but docs/models.md says {documented}"
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}  # shared, not copied
    model.train()
    batch = check_batch(model.config.vocab_size, n=4)
    labels, real = labels_of(batch), batch["attention_mask"].bool()
    reference = model(**batch, labels=labels, use_cache=False)
    reference.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for k in (2, 3):
        model.zero_grad()
        logits = pipelined(seq, batch, k)
        torch.testing.assert_close(logits[real], reference.logits[real], rtol=0, atol=1e-5)
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        assert abs(loss.item() - reference.loss.item()) <= 1e-5
        loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        for name, grad in got.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=f"K={k}: {name}")


def test_three_quarters_of_the_families_are_exact_and_the_table_lists_every_one():
    """Three quarters of the families with a plan are exact (the built-in ones not counted); the
    table lists those and the families with a built-in plan."""
    documented = _documented()
    assert sorted(documented) == sorted(f for f, _ in FAMILIES)
    assert sum(documented[f] == "exact" for f, _ in PLANS) >= 0.75 * len(PLANS)
    for family in ("granite", "cohere", "gemma2", "mistral", "llama", "qwen2", "phi3", "starcoder2"):
        assert documented[family] == "exact", family
    for family in ("gpt2", "gpt_neo", "stablelm", "falcon", "gpt_bigcode"):  # no plan in transformers 5.25
        assert documented[family] == "exact", family


PADDED = [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("gpt2", "GPT2LMHeadModel")]


def _padded_batch(vocab: int) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """Rows of 10, 6 (left-padded), 7 (right-padded) and 4 (left-padded) real tokens, position ids
    counting real tokens only; and each row's real slice."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (4, 10), generator=g)
    real = [slice(0, 10), slice(4, 10), slice(0, 7), slice(6, 10)]
    mask = torch.zeros(4, 10, dtype=torch.long)
    for row, part in enumerate(real):
        mask[row, part] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, real


@pytest.mark.parametrize(("model_type", "class_name"), PADDED, ids=[f for f, _ in PADDED])
def test_padded_batch_gives_each_sequence_its_own_logits_and_the_model_loss(model_type, class_name):
    """Mixed lengths, left and right padding (Mistral: a window of 3 over up to 10 tokens), cut into
    2 stages on 2 micro-batches: each real token's logits equal those of its sequence run alone,
    unpadded; the loss equals the model's own with the same mask."""
    model = tiny(model_type, class_name).eval()
    seq = causal_lm(model)
    batch, real = _padded_batch(model.config.vocab_size)
    with torch.no_grad():
        logits = pipelined(seq, batch, 2)
        for row, part in enumerate(real):
            alone = model(input_ids=batch["input_ids"][row : row + 1, part], use_cache=False).logits[0]
            torch.testing.assert_close(logits[row, part], alone, rtol=0, atol=1e-5)
        labels = labels_of(batch)
        expected = model(**batch, labels=labels, use_cache=False).loss
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
    assert abs(loss.item() - expected.item()) <= 1e-6
    with torch.no_grad():  # without position ids, as the model: positions count the padding
        plain = {k: batch[k] for k in ("input_ids", "attention_mask")}
        reference = model(**plain, use_cache=False).logits
        mask = batch["attention_mask"].bool()
        torch.testing.assert_close(pipelined(seq, plain, 2)[mask], reference[mask], rtol=0, atol=1e-5)


def test_packed_sequences_attend_only_to_themselves():
    """One row holding sequences of 4 and 6 tokens, position ids restarting at 0, no mask: each
    sequence's logits equal it run alone."""
    model = tiny("llama", "LlamaForCausalLM").eval()
    seq = causal_lm(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(4), torch.arange(6)]).expand(2, 10)
    with torch.no_grad():
        logits = pipelined(seq, {"input_ids": ids, "position_ids": positions}, 2)
        for part in (slice(0, 4), slice(4, 10)):
            alone = model(input_ids=ids[:, part], use_cache=False).logits
            torch.testing.assert_close(logits[:, part], alone, rtol=0, atol=1e-5)
        unpacked = model(input_ids=ids, use_cache=False).logits  # the packing does change the logits
        assert (logits[:, 4:] - unpacked[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("model_type", "class_name", "why"),
    [
        ("bloom", "BloomForCausalLM", "no pipeline plan"),
        ("mpt", "MptForCausalLM", "no pipeline plan"),
        ("opt", "OPTForCausalLM", "no pipeline plan"),
        ("qwen3_next", "Qwen3NextForCausalLM", "layer types ['linear_attention']"),
        ("phi4_multimodal", "Phi4MultimodalForCausalLM", "parameters outside its plan's parts"),
    ],
)
def test_families_it_cannot_cut_are_refused_by_name(model_type, class_name, why):
    model = tiny(model_type, class_name)
    with pytest.raises(UnsupportedModelError, match=re.escape(why)) as error:
        causal_lm(model)
    assert f"cannot cut {model_type} ({class_name}" in str(error.value)
    assert "build the nn.Sequential by hand" in str(error.value)


def test_a_built_in_plan_is_still_checked_falcon_with_alibi_is_refused():
    """Falcon's built-in plan cuts its rotary configuration exactly (above); with ``alibi=True`` its
    layers take a bias the chain does not build, and the check refuses it by name."""
    with pytest.raises(UnsupportedModelError, match=r"reproduce falcon \(FalconForCausalLM\).*differs"):
        causal_lm(tiny("falcon", "FalconForCausalLM", alibi=True))


def test_encoder_decoders_and_other_modules_are_refused():
    with pytest.raises(UnsupportedModelError, match="t5 .* it is an encoder-decoder"):
        causal_lm(tiny("t5", "T5ForConditionalGeneration"))
    with pytest.raises(TypeError, match="takes a transformers causal LM .* not Linear"):
        causal_lm(torch.nn.Linear(2, 2))


def test_the_dict_input_is_checked():
    seq = causal_lm(tiny("llama", "LlamaForCausalLM"))
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"got keys \['input_ids', 'labels'\]; drop \['labels'\]"):
        seq({"input_ids": ids, "labels": ids})
    with pytest.raises(
        ValueError, match=r"attention_mask must have the shape of input_ids \(2, 5\), got \(2, 4\)"
    ):
        seq({"input_ids": ids, "attention_mask": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"input_ids must be \(N, T\), got shape \(5,\)"):
        seq(ids[0])
