"""A model pipelined by naming its parts (``GPipeStrategy(plan=...)``, issue 39): the chain of its layers
under the model's own names, trained in one process as the stages would train it (:mod:`tests.fakes`),
installed in the model (its keys the class's own), and the plans and forwards that are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_gpipe.engine.stage import PipelineUsageError, StageDone
from lightning_gpipe.errors import PartitionError
from lightning_gpipe.partition import plan
from lightning_gpipe.partition.build import build_stage
from lightning_gpipe.partition.compiling import stage_compiler
from lightning_gpipe.partition.cut import PLACEHOLDER
from lightning_gpipe.partition.plan_forward import PlanForward
from lightning_gpipe.schedule import SCHEDULES
from lightning_gpipe.state.full import merged_optimizer_state
from lightning_gpipe.state.materialize import check_nothing_meta, materialize_stage
from lightning_gpipe.strategy.pipelined import Pipelined
from lightning_gpipe.transport.layout import Layout
from tests.fakes import Recorder, TurnNetwork, TurnP2P, in_threads, micro_step
from tests.gpt import GPT, PLAN, VOCAB, gpt_data

TIGHT = {"atol": 1e-5, "rtol": 0}
CPU = torch.device("cpu")


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _chain(model, steps=PLAN, k=2, balance=None):
    return plan.check_model(model, plan.check_plan(steps), None, balance, k, 1)


def _stages(chain, balance, schedule, chunks=4, checkpoint="except_last"):
    k, network, stages = len(balance), TurnNetwork(), []
    for j in range(k):
        rank = Layout(k, k).rank(0, j)
        stage = build_stage(chain, balance, Layout(k, k), rank, chunks, checkpoint, CPU, SCHEDULES[schedule])
        stage.p2p, stage.timeline = TurnP2P(network, rank), Recorder(stage)
        stages.append(stage)
    return stages


def _step(stages, calls, ids, schedule, chunks=4):
    """One training step, each stage in a thread, the user's call ``calls[j](x)`` (the stage, or the model
    whose forward is the installed stage); returns the last stage's loss."""
    losses = {}

    def body(stage):
        call, last = calls[stage.topology.stage], stage.topology.is_last
        if schedule == "gpipe":
            out = stage.run_step(call, True, ids)
            loss = _loss(out, ids) if last else None
            shared = stage.share_outcome(loss, None, training=True)
            if last:
                loss.backward()
            stage.backward()
        else:
            shared = micro_step(stage, (ids, ids), lambda b: _loss(call(b[0]), b[1]), chunks)
        losses[stage.topology.stage] = shared.detach()

    in_threads(stages, body, turn=stages[0].p2p.network.turn)
    return [losses[j] for j in range(len(stages))]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_module_list_gpt_trains_like_one_device(schedule):
    """The nanoGPT-style model (tied head), cut into 2 stages by plan=PLAN ([3, 4] layers): 4 SGD steps
    (momentum 0.9) give every stage the one-device loss and every weight the one-device value, within 1e-5."""
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    _, chain, _ = _chain(model)
    stages = _stages(chain, [3, 4], schedule)
    ours, theirs = model.configure_optimizers(), ref.configure_optimizers()
    for (ids,) in gpt_data():
        ours.zero_grad()
        theirs.zero_grad()
        losses = _step(stages, stages, ids, schedule)
        expected = _loss(ref(ids), ids)
        expected.backward()
        for loss in losses:
            torch.testing.assert_close(loss, expected.detach(), **TIGHT)
        ours.step()
        theirs.step()
    assert model.head.weight is model.embed.tok.weight
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TIGHT, msg=name)


def test_compiled_stages_of_a_list_plan_train_like_one_device():
    """``compile=`` with a list plan: each stage's layers compiled as the strategy compiles them
    (:func:`stage_compiler`, the eager backend), the GPT cut [3, 4] (tied head), 2 micro-batches: 2 SGD
    steps give the one-device loss and weights within 1e-5, and the stages ran their compiled modules."""
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    _, chain, _ = _chain(model)
    stages = _stages(chain, [3, 4], "gpipe", chunks=2, checkpoint="never")
    compiler = stage_compiler({"backend": "eager"}, None)
    for stage in stages:
        stage.compile(compiler)
    ours, theirs = model.configure_optimizers(), ref.configure_optimizers()
    for (ids,) in list(gpt_data())[:2]:
        ours.zero_grad()
        theirs.zero_grad()
        losses = _step(stages, stages, ids, "gpipe", chunks=2)
        expected = _loss(ref(ids), ids)
        expected.backward()
        for loss in losses:
            torch.testing.assert_close(loss, expected.detach(), **TIGHT)
        ours.step()
        theirs.step()
    assert all(type(c).__name__ == "OptimizedModule" for s in stages for c in s.executor.compiled)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TIGHT, msg=name)


class Reshaped(GPT):
    """The GPT with a part without parameters between the blocks and the norm: ``(N, T, D)`` →
    ``(N, T, D)`` through a reshape, a stage of its own under ``balance=[5, 1, 2]``."""

    def __init__(self) -> None:
        super().__init__(tied=False)
        self.fold = nn.Sequential(nn.Unflatten(-1, (2, -1)), nn.Flatten(-2))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(self.fold(x)))


RESHAPED = ["embed", "blocks", "fold", "norm", "head"]


def test_a_plan_stage_without_parameters_gets_a_placeholder_as_a_sequentials_does():
    """Three stages, the middle one holding only ``fold`` (no parameter): each stage installed in its own
    copy of the model, ``configure_optimizers`` over ``self.parameters()`` builds on every stage (the
    middle one's optimizer holds one empty parameter, as a Sequential's stage's does); one step gives the
    one-device loss and gradients; the placeholder never reaches ``state_dict`` (a strict load of the
    stage's part works) or the merged optimizer state's names, and it is gone after uninstalling."""
    torch.manual_seed(0)
    model = Reshaped()
    ref = copy.deepcopy(model)
    copies = [copy.deepcopy(model) for _ in range(3)]
    chains = [_chain(c, RESHAPED, k=3, balance=[5, 1, 2])[1] for c in copies]
    network, stages, pipes = TurnNetwork(), [], []
    for j in range(3):
        stage = _stages(chains[j], [5, 1, 2], "gpipe")[j]
        stage.p2p = TurnP2P(network, Layout(3, 3).rank(0, j))
        pipe = Pipelined()
        pipe.stage, pipe.installed = stage, plan.install(chains[j], stage, PlanForward(chains[j], stage))
        stages.append(stage)
        pipes.append(pipe)
    optimizers = []
    for pipe, c in zip(pipes, copies):
        with pipe.configuring(CPU):
            optimizers.append(torch.optim.Adam(filter(lambda p: p.requires_grad, c.parameters())))
    middle = [p for g in optimizers[1].param_groups for p in g["params"]]
    assert len(middle) == 1 and middle[0].numel() == 0
    assert all(PLACEHOLDER not in n for c in (copies[0], copies[2]) for n, _ in c.named_parameters())
    assert list(copies[1].state_dict()) == []
    copies[1].load_state_dict({}, strict=True)
    (ids,) = next(iter(gpt_data()))
    losses = _step(stages, copies, ids, "gpipe")
    expected = _loss(ref(ids), ids)
    expected.backward()
    for loss in losses:
        torch.testing.assert_close(loss, expected.detach(), **TIGHT)
    grads = {n: p.grad for c in copies for n, p in c.named_parameters() if PLACEHOLDER not in n}
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **TIGHT, msg=n)
    for optimizer in optimizers:
        optimizer.step()
    merged = merged_optimizer_state(optimizers[1], copies[1], Layout(3, 3), Layout(3, 3).rank(0, 1))
    assert merged["param_groups"][0]["params"] == [] and merged["state"] == {}
    plan.uninstall(pipes[1].installed, ref.state_dict())
    assert [n for n, _ in copies[1].named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_chain_holds_the_parts_under_the_models_own_names():
    model = GPT()
    name, chain, balance = _chain(model, k=3)
    assert name == "" and balance == [3, 2, 2]
    assert list(chain._modules) == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    assert chain.state_dict().keys() == model.state_dict().keys()
    assert chain._modules["blocks.2"] is model.blocks[2]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_installed_stages_run_the_users_call_and_keep_the_class_keys(schedule):
    """Each stage installed in its own copy of the model: the model holds only that stage's layers under
    the class's keys (together: all of them), ``model(ids)`` runs the stage, one step gives the one-device
    loss and gradients (the tied weight's two copies' gradients add up to one device's), and uninstalling
    puts the class back whole, loading a state_dict of the class with strict=True."""
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    copies = [copy.deepcopy(model) for _ in range(2)]
    chains = [_chain(c)[1] for c in copies]
    stages = [_stages(chain, [3, 4], schedule)[j] for j, chain in enumerate(chains)]
    network = TurnNetwork()
    for j, stage in enumerate(stages):
        stage.p2p = TurnP2P(network, Layout(2, 2).rank(0, j))
    installed = [plan.install(chains[j], stages[j], PlanForward(chains[j], stages[j])) for j in range(2)]
    held = [list(c.state_dict()) for c in copies]
    assert held[0] == keys[: len(held[0])] and held[0][-1].startswith("blocks.1.")
    assert held[1][0].startswith("blocks.2.") and held[1][-1] == "head.weight"
    assert set(held[0]) | set(held[1]) == set(keys) and not set(held[0]) & set(held[1])
    assert [n for n, _ in copies[1].named_parameters()][0].startswith("blocks.2.")  # optimizer names
    (ids,) = next(iter(gpt_data()))
    losses = _step(stages, copies, ids, schedule)
    expected = _loss(ref(ids), ids)
    expected.backward()
    for loss in losses:
        torch.testing.assert_close(loss, expected.detach(), **TIGHT)
    grads = {n: p.grad for c in copies for n, p in c.named_parameters()}
    for n, p in ref.named_parameters():
        got = grads[n] if n != "embed.tok.weight" else grads[n] + copies[1].head.weight.grad
        torch.testing.assert_close(got, p.grad, **TIGHT, msg=n)
    for j in range(2):
        part = {k: v for k, v in ref.state_dict().items() if k in held[j]}
        copies[j].load_state_dict(part, strict=True)  # a stage's part of a checkpoint, as a load gives it
        plan.uninstall(installed[j], ref.state_dict())
        assert list(copies[j].state_dict()) == keys and "forward" not in vars(copies[j])
        torch.testing.assert_close(copies[j].state_dict(), ref.state_dict(), rtol=0, atol=0)


def test_whole_puts_every_part_back_inside():
    model = GPT()
    _, chain, _ = _chain(model)
    stage = _stages(chain, [3, 4], "gpipe")[1]
    installed = plan.install(chain, stage, PlanForward(chain, stage))
    with plan.whole(installed):
        assert model.state_dict().keys() == GPT().state_dict().keys()
    assert "embed.tok.weight" not in model.state_dict()
    plan.uninstall(installed)


# -- a dict plan: parts that pass several named tensors --------------------------------------------


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, mask):
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1)


class Tagger(nn.Module):
    """``forward(x, mask)``: ``inp`` gives ``h``, each of ``layers`` takes ``(h, mask)``."""

    automatic_optimization = True  # as a LightningModule's

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.layers = nn.ModuleList(Masked() for _ in range(3))
        self.out = nn.Linear(4, 2)

    def forward(self, x, mask):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, mask)
        return self.out(h)


DICT_PLAN = {"inp": (["x"], ["h"]), "layers": (["h", "mask"], ["h"]), "out": (["h"], ["y"])}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dict_plan_passes_the_mask_to_every_stage(schedule):
    """The transformers format: the forward's ``mask`` reaches the layers on both stages; the user calls
    ``model(x, mask)``; loss and gradients equal one device's."""
    torch.manual_seed(0)
    model = Tagger()
    ref = copy.deepcopy(model)
    copies = [copy.deepcopy(model) for _ in range(2)]
    chains = [plan.check_model(c, plan.check_plan(DICT_PLAN), None, [2, 3], 2, 1)[1] for c in copies]
    assert chains[0].entry == ["x", "mask"] and chains[0].result == ["y"]
    network, stages = TurnNetwork(), []
    for j in range(2):
        stage = _stages(chains[j], [2, 3], schedule)[j]
        stage.p2p = TurnP2P(network, Layout(2, 2).rank(0, j))
        plan.install(chains[j], stage, PlanForward(chains[j], stage))
        stages.append(stage)
    x, mask = torch.randn(8, 5, 3), torch.rand(8, 5) > 0.3
    y = torch.randn(8, 5, 2)
    losses = {}

    def body(stage):
        j = stage.topology.stage
        if schedule == "gpipe":
            out = stage.run_step(copies[j], True, x, mask)
            loss = F.mse_loss(out, y) if j == 1 else None
            shared = stage.share_outcome(loss, None, training=True)
            if j == 1:
                loss.backward()
            stage.backward()
        else:
            shared = micro_step(
                stage, (x, mask, y), lambda b: F.mse_loss(copies[j](b[0], mask=b[1]), b[2]), 2
            )
        losses[j] = shared.detach()

    in_threads(stages, body, turn=network.turn)
    expected = F.mse_loss(ref(x, mask), y)
    expected.backward()
    torch.testing.assert_close(losses[0], expected.detach(), **TIGHT)
    torch.testing.assert_close(losses[1], expected.detach(), **TIGHT)
    grads = {n: p.grad for c in copies for n, p in c.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **TIGHT, msg=n)


# -- refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (["embed", "blocks", "blocks", "head"], "lists 'blocks' more than once"),
        ("embed", "plan must name the model's parts"),
        ([], "plan names nothing"),
        (["embed", "transformer.h"], "no dots"),
        ({"embed": ["x"]}, r"maps each part to \(inputs, outputs\)"),
    ],
)
def test_bad_plans_are_refused_at_construction(steps, message):
    with pytest.raises(ValueError, match=message):
        plan.check_plan(steps)


def test_a_name_that_is_not_a_part_is_refused_with_the_parts_there_are():
    with pytest.raises(PartitionError, match="'embd', which is not a submodule of GPT.*embed, blocks, norm"):
        _chain(GPT(), ["embd", "blocks", "norm", "head"])


def test_parameters_outside_the_plan_are_refused_naming_them():
    with pytest.raises(
        PartitionError, match=r"outside plan=\['embed', 'blocks', 'head'\]: norm.weight, norm.bias"
    ):
        _chain(GPT(), ["embed", "blocks", "head"])


def test_a_dict_plan_input_nobody_gives_is_refused():
    bad = {**DICT_PLAN, "layers": (["h", "attention_mask"], ["h"])}
    with pytest.raises(PartitionError, match="'attention_mask'.*Tagger.forward has no argument"):
        plan.check_model(Tagger(), plan.check_plan(bad), None, None, 2, 1)


def test_a_plan_of_a_submodule_keeps_its_path():
    outer = nn.Module()
    outer.automatic_optimization = True
    outer.model = GPT(tied=False)
    name, chain, _ = _chain(outer)
    assert name == "model" and chain.state_dict().keys() == outer.model.state_dict().keys()


class InlinePosition(GPT):
    """nanoGPT as written: the position embedding added in the forward, between two parts."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, 16), nn.Embedding(8, 16)
        del self.embed

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LossInForward(GPT):
    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        return logits if targets is None else (logits, _loss(logits, targets))


class Skips(GPT):
    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks[:-1]:
            x = block(x)
        return self.head(self.norm(x))


class Scales(GPT):
    def forward(self, idx):
        return super().forward(idx) * 0.5


class Dropped(GPT):
    """A dropout outside the plan: the identity in evaluation mode, so only the training check sees it."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, idx):
        x = self.drop(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Casts(GPT):
    """A half-precision model whose forward casts the blocks' output to float32 before the norm."""

    def __init__(self):
        super().__init__()
        self.blocks.to(torch.bfloat16)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.float()))


@pytest.mark.parametrize(
    ("cls", "steps", "args", "message"),
    [
        (InlinePosition, ["wte", "wpe", "blocks", "norm", "head"], 1, "'wpe' is called with something other"),
        (LossInForward, PLAN, 2, "LossInForward.forward is not the chain that plan= names"),
        (Skips, PLAN, 1, "it calls .*'blocks.2', 'norm'"),
        (Scales, PLAN, 1, "returns something other than the output of 'head'"),
        (Dropped, PLAN, 1, "in training mode 'blocks.0' is called .*outside plan=: drop;"),
        (Casts, PLAN, 1, "'norm' is called with something other than the output of 'blocks.3'"),
    ],
)
def test_a_forward_that_is_not_the_chain_is_refused_at_its_first_call(cls, steps, args, message):
    """Checked with stand-ins for the parts on the first call, on every stage; the message says what to
    change."""
    model = cls()
    model.head.weight = nn.Parameter(torch.randn(VOCAB, 16))  # untied: the tie is the class's business
    _, chain, _ = _chain(model, steps)
    stage = _stages(chain, [3, len(chain) - 3], "gpipe")[1]
    plan.install(chain, stage, PlanForward(chain, stage))
    (ids,) = next(iter(gpt_data()))
    model.eval()  # the check runs training and evaluation modes alike, and leaves the modes as they were
    with pytest.raises(PipelineUsageError, match=message) as err:
        stage.run_step(model, True, *[ids] * args)
    assert not any(m.training for m in model.modules())
    assert "docs/models.md" in str(err.value) and "position embedding" in str(err.value)


class ScalesWithMetrics(Scales):
    """Submodules the forward never calls, outside the plan: a loss module and a torchmetrics metric."""

    def __init__(self):
        super().__init__()
        self.criterion = nn.CrossEntropyLoss()
        self.val_mse = torchmetrics.MeanSquaredError()


@pytest.mark.parametrize(("cls", "named"), [(ScalesWithMetrics, None), (Dropped, "drop")])
def test_the_refusal_names_as_parts_only_the_submodules_the_forward_calls(cls, named):
    """A metric or a loss module outside plan= is not a part to add; a dropout called between parts is."""
    model = cls()
    model.head.weight = nn.Parameter(torch.randn(VOCAB, 16))
    _, chain, _ = _chain(model, PLAN)
    stage = _stages(chain, [3, len(chain) - 3], "gpipe")[1]
    plan.install(chain, stage, PlanForward(chain, stage))
    (ids,) = next(iter(gpt_data()))
    with pytest.raises(PipelineUsageError) as err:
        stage.run_step(model, True, ids)
    text = str(err.value)
    assert "criterion" not in text and "val_mse" not in text
    if named is None:
        assert "outside plan=" not in text
    else:
        assert f"calls submodules outside plan=: {named}; name them in plan=" in text


def test_the_chain_check_computes_nothing_and_passes_the_gpt():
    """The check runs the forward on stand-ins: a non-last stage then leaves the step as always."""
    model = GPT()
    _, chain, _ = _chain(model)
    stage = _stages(chain, [3, 4], "gpipe")[0]
    forward = PlanForward(chain, stage)
    plan.install(chain, stage, forward)
    (ids,) = next(iter(gpt_data()))
    before = torch.get_rng_state()
    with pytest.raises(StageDone):
        stage.begin_step(False)
        model(ids)
    stage.end_step()
    assert forward.checked and torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("j", [0, 1])
def test_a_model_built_on_meta_materializes_only_its_stage(j):
    """Stage-only (meta-device construction): each stage's layers get real tensors, the model then holds
    no meta tensor (only its stage), under the class's keys."""
    with torch.device("meta"):
        model = GPT()
    _, chain, _ = _chain(model)
    materialize_stage(model, "", chain, [3, 4], j, CPU, 2)
    stage = _stages(chain, [3, 4], "gpipe")[j]
    plan.install(chain, stage, PlanForward(chain, stage))
    check_nothing_meta(model)
    held = list(model.state_dict())
    assert held[0] == ("embed.tok.weight" if j == 0 else "blocks.2.ln1.weight")
    assert not any(t.is_meta for t in model.state_dict().values())
    assert all(t.is_meta for n, t in chain.state_dict().items() if n not in held)


@pytest.mark.parametrize("j", [0, 1])
def test_a_meta_model_installed_stage_only_names_its_tied_parameter_once(j):
    """``Pipelined.install`` of the GPT built on the meta device (head tied to the embedding): after this
    stage is materialized the head's and the embedding's tensors are no longer one, but the model's
    parameter names (which a one-device optimizer state is read by, in order) still list the tied
    parameter once, as the plain class does."""
    with torch.device("meta"):
        model = GPT()
    checked = _chain(model, balance=[3, 4])
    pipe, layout = Pipelined(), Layout(2, 2)

    def build(chain, balance):
        return build_stage(chain, balance, layout, layout.rank(0, j), 4, "except_last", CPU)

    pipe.install(model, checked, [3, 4], layout, layout.rank(0, j), CPU, lambda seq, b: b, build)
    head, embed = checked[1]._modules["head"].weight, checked[1]._modules["embed"].tok.weight
    assert pipe.stage_only and head is not embed and (head.is_meta, embed.is_meta) == (j == 0, j == 1)
    assert pipe.plain_names == [n for n, _ in GPT().named_parameters()]
    assert pipe.tied_aliases() == (
        {"embed.tok.weight": None} if j == 0 else {"head.weight": "embed.tok.weight"}
    )


def test_a_step_that_uses_the_parts_directly_is_told_to_call_the_model():
    """A stage's model holds only its parts: using one (``self.blocks``) raises, saying to call the model."""
    model = GPT()
    _, chain, _ = _chain(model)
    stage = _stages(chain, [3, 4], "gpipe")[1]
    plan.install(chain, stage, PlanForward(chain, stage))
    (ids,) = next(iter(gpt_data()))
    with pytest.raises(
        PipelineUsageError, match=r"part 'embed' was used directly.*call the model, self\(x\)"
    ):
        model.embed(ids)
    with pytest.raises(PipelineUsageError, match=r"part 'blocks' was used directly \(stage 1 holds"):
        next(iter(model.blocks))
    assert list(model.blocks.state_dict()) == [
        k.removeprefix("blocks.") for k in model.state_dict() if "blocks." in k
    ]
