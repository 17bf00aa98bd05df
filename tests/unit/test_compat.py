"""Every private torch and Lightning internal (``_compat``, ``_lightning``) exists and behaves as used.

One test per entry: an upgrade that removes or changes one fails here, naming it.
"""

import inspect
import os
import sys

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gpipe import _compat, _lightning


def test_every_entry_has_a_test():
    tested = {
        name.removeprefix("test_")
        for name, _ in inspect.getmembers(sys.modules[__name__], inspect.isfunction)
    }
    entries = set(_compat.__all__) | set(_lightning.__all__)
    assert entries <= tested, sorted(entries - tested)


@pytest.mark.parametrize(("owner", "name"), _lightning.OVERRIDDEN, ids=lambda x: getattr(x, "__name__", x))
def test_OVERRIDDEN(owner, name):
    if name == "_launcher":  # an instance attribute, set in Strategy.__init__
        owner = pl.strategies.DDPStrategy()
    assert hasattr(owner, name), f"{owner} has no {name} any more"


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 1))
        self.seen = {}

    def setup(self, stage):
        self.seen["dataloader"] = _lightning.train_dataloader(self.trainer)
        self.seen["trainer"] = _lightning.attached_trainer(self)

    def training_step(self, batch, batch_idx):
        self.seen.setdefault("accumulate", []).append(_lightning.should_accumulate(self.trainer))
        return self.layers(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    model = _Tiny()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path_factory.mktemp("fit"),
    )  # fmt: skip
    trainer.fit(model)
    return model, trainer


def test_train_dataloader(fitted):
    model, _ = fitted
    assert isinstance(model.seen["dataloader"], torch.utils.data.DataLoader)


def test_should_accumulate(fitted):
    model, _ = fitted
    assert model.seen["accumulate"][:2] == [True, False]


def test_set_sigterm_check(fitted):
    _, trainer = fitted
    loop = trainer.fit_loop.epoch_loop
    assert callable(type(loop)._broadcast_sigterm_tensor)  # what the check stands in for
    calls = []
    _lightning.set_sigterm_check(trainer, lambda: calls.append(1))
    loop._broadcast_sigterm_tensor()
    assert calls == [1]
    _lightning.set_sigterm_check(trainer, None)
    assert "_broadcast_sigterm_tensor" not in vars(loop)


def test_set_sigterm_notifier(fitted):
    """The notifier is looked up where the Trainer registers its SIGTERM handler: ours is called in its
    place, and Lightning's own comes back."""
    import signal

    _, trainer = fitted
    connector = trainer._signal_connector
    assert callable(type(connector)._sigterm_notifier_fn)  # what the notifier stands in for
    calls = []
    before = signal.getsignal(signal.SIGTERM)
    _lightning.set_sigterm_notifier(trainer, lambda signum, frame: calls.append(signum))
    try:
        connector.register_signal_handlers()
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert calls == [signal.SIGTERM] and not trainer.received_sigterm
    finally:
        connector.teardown()
        _lightning.set_sigterm_notifier(trainer, None)
    assert signal.getsignal(signal.SIGTERM) == before
    assert "_sigterm_notifier_fn" not in vars(connector)


def test_sigterm_exception(fitted):
    _, trainer = fitted
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    assert _lightning.sigterm_exception(trainer) is SIGTERMException


def test_attached_trainer(fitted):
    model, trainer = fitted
    assert model.seen["trainer"] is trainer
    assert _lightning.attached_trainer(_Tiny()) is None


def test_layer_sync():
    assert _lightning.layer_sync(pl.strategies.DDPStrategy()) is None
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, logger=False)
    assert _lightning.layer_sync(trainer.strategy) is not None


def test_unwrap_optimizer():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    assert _lightning.unwrap_optimizer(pl.core.optimizer.LightningOptimizer(optimizer)) is optimizer
    assert _lightning.unwrap_optimizer(optimizer) is optimizer


def test_StrategyRegistry():
    assert isinstance(pl.strategies.StrategyRegistry, _lightning.StrategyRegistry)


def test_SubprocessScriptLauncher():
    assert {"launch", "procs"} <= set(dir(_lightning.SubprocessScriptLauncher)) | {"procs"}
    assert "cluster_environment" in inspect.signature(_lightning.SubprocessScriptLauncher).parameters


def test_distributed_is_initialized():
    assert _lightning.distributed_is_initialized() is False


def test_default_process_group_backend():
    assert _lightning.default_process_group_backend(torch.device("cpu")) == "gloo"


def test_init_dist_connection():
    parameters = inspect.signature(_lightning.init_dist_connection).parameters
    assert list(parameters)[:2] == ["cluster_environment", "torch_distributed_backend"]


def test_sync_ddp():
    assert {"result", "group", "reduce_op"} <= set(inspect.signature(_lightning.sync_ddp).parameters)


def test_optimizer_to_device():
    layer = nn.Linear(1, 1)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    _lightning.optimizer_to_device(optimizer, torch.device("cpu"))
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())


def test_optimizers_to_device():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    _lightning.optimizers_to_device([optimizer], torch.device("cpu"))


def test_BatchNormBase():
    assert all(issubclass(c, _compat.BatchNormBase) for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
    assert not issubclass(nn.LayerNorm, _compat.BatchNormBase)


def test_flatten_dense_tensors():
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = _compat.flatten_dense_tensors(tensors)
    assert flat.shape == (7,)


def test_unflatten_dense_tensors():
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    back = _compat.unflatten_dense_tensors(_compat.flatten_dense_tensors(tensors), tensors)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_children():
    layer = nn.Tanh()
    seq = nn.Sequential(layer, layer)  # a repeated module: named_children() would list it once
    assert list(_compat.children(seq)) == ["0", "1"] and len(list(seq.named_children())) == 1


def test_own_parameters():
    layer = nn.Linear(1, 1)
    _compat.own_parameters(layer)["bias"] = None
    assert layer.bias is None and set(_compat.own_parameters(layer)) == {"weight", "bias"}


def test_own_buffers():
    norm = nn.BatchNorm1d(2)
    assert set(_compat.own_buffers(norm)) == {"running_mean", "running_var", "num_batches_tracked"}


def test_register_state_dict_hook():
    layer = nn.Linear(1, 1)

    def drop(module, state, prefix, local_metadata):
        state.pop(prefix + "bias")

    _compat.register_state_dict_hook(layer, drop)
    assert set(layer.state_dict()) == {"weight"}


def test_scaler_device():
    assert _compat.scaler_device(torch.amp.GradScaler("cpu")) == "cpu"


def test_scaler_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    assert float(_compat.scaler_scale(scaler)) == 4.0


def test_scaler_optimizer_state():
    layer = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(layer(torch.ones(1, 1)).sum()).backward()
    scaler.unscale_(optimizer)
    assert "found_inf_per_device" in _compat.scaler_optimizer_state(scaler, optimizer)


def test_running_loop_data(fitted):
    model, trainer = fitted
    step, loader = _lightning.running_loop_data(trainer)  # the last loop the trainer ran: fit
    assert step == "training_step" and isinstance(loader, torch.utils.data.DataLoader)


def test_IS_INTERACTIVE():
    assert _lightning.IS_INTERACTIVE is False  # pytest is not an interactive session


def test_MultiProcessingLauncher():
    params = inspect.signature(_lightning.MultiProcessingLauncher).parameters
    assert {"strategy", "start_method"} <= set(params)
    assert hasattr(_lightning.MultiProcessingLauncher, "is_interactive_compatible")


def test_OptimizedModule():
    assert isinstance(torch.compile(nn.Linear(2, 2)), _compat.OptimizedModule)


def test_compiled_module():
    layer = nn.Linear(2, 2)
    assert _compat.compiled_module(torch.compile(layer)) is layer


def test_compile_like():
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    again = _compat.compile_like(compiled, nn.Linear(2, 3))
    assert isinstance(again, _compat.OptimizedModule) and again(torch.ones(1, 2)).shape == (1, 3)


def test_example_input_slot():
    model = _Tiny()
    model.example_input_array = torch.ones(1, 2)
    assert torch.equal(_lightning.example_input_slot(model), torch.ones(1, 2))


def test_set_example_input_slot():
    model = _Tiny()
    model.example_input_array = torch.ones(1, 2)
    _lightning.set_example_input_slot(model, None)
    assert model.example_input_array is None


def test_set_device_mesh():
    model, mesh = _Tiny(), object()  # any value: the property returns what is stored
    _lightning.set_device_mesh(model, mesh)
    assert model.device_mesh is mesh
    _lightning.set_device_mesh(model, None)
    assert model.device_mesh is None
    _lightning.set_device_mesh(None, mesh)  # no module: nothing to set, no error


def test_clear_device_meshes():
    first, second, mesh = _Tiny(), _Tiny(), object()
    _lightning.set_device_mesh(first, mesh)
    _lightning.set_device_mesh(second, mesh)
    _lightning.clear_device_meshes()
    assert first.device_mesh is None and second.device_mesh is None


def test_throughputs():
    from pytorch_lightning.callbacks import ThroughputMonitor

    monitor = ThroughputMonitor(batch_size_fn=len)
    assert _lightning.throughputs(monitor) == []  # filled in setup, one per running stage


def test_checkpoint_offset(tmp_path):
    data = torch.arange(6, dtype=torch.float32)
    torch.save({"x": data}, tmp_path / "c.pt")
    meta = torch.load(tmp_path / "c.pt", map_location="meta", weights_only=True)["x"]
    offset = _compat.checkpoint_offset(meta.untyped_storage())
    raw = (tmp_path / "c.pt").read_bytes()[offset : offset + data.numel() * 4]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), data)


class _Hparams(pl.LightningModule):
    def __init__(self, width: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 1)


def test_load_module_state():
    saved = _Hparams(width=3)
    checkpoint = {"state_dict": saved.state_dict(), "hyper_parameters": {"width": 3}}
    model = _lightning.load_module_state(_Hparams, checkpoint, strict=True)
    assert model.layer.in_features == 3 and torch.equal(model.layer.weight, saved.layer.weight)


def test_migrate_checkpoint():
    checkpoint = {"state_dict": {}, "pytorch-lightning_version": pl.__version__}
    assert _lightning.migrate_checkpoint(checkpoint, None)["state_dict"] == {}


def test_tree_flatten():
    leaves, spec = _compat.tree_flatten({"a": (1, torch.zeros(1)), "b": [None, "s"]})
    assert leaves[0] == 1 and isinstance(leaves[1], torch.Tensor) and leaves[2:] == [None, "s"]
    assert isinstance(spec, _compat.TreeSpec)


def test_tree_unflatten():
    value = {"a": (1, 2.5), "b": [None, "s"], 3: ()}
    leaves, spec = _compat.tree_flatten(value)
    assert _compat.tree_unflatten(leaves, spec) == value


def test_tree_leaf_paths():
    assert _compat.tree_leaf_paths({"a": [1, (2,)], 3: None}) == [
        ("['a'][0]", 1),
        ("['a'][1][0]", 2),
        ("[3]", None),
    ]


def test_TreeSpec():
    assert (
        _compat.tree_flatten((1, 2))[1] == _compat.tree_flatten((3, 4))[1] != _compat.tree_flatten([1, 2])[1]
    )


def test_profiler_enabled():
    assert not _compat.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _compat.profiler_enabled()
    assert not _compat.profiler_enabled()


def test_unrecorded():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with _compat.unrecorded():
            torch.ones(3).add(1)
        torch.ones(3).mul(2)
    names = {e.name for e in prof.events()}
    assert "aten::mul" in names and "aten::add" not in names


def test_TorchDispatchMode():
    seen = []

    class Ops(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.ones(2) + 1
    assert any("add" in name for name in seen)


def test_tree_leaves():
    assert _compat.tree_leaves({"a": [1, torch.ones(1)], "b": (None,)})[:1] == [1]


class _Allowed:
    pass


def test_weights_only_globals():
    found = _compat.weights_only_globals()
    assert found["torch.Size"] is torch.Size and found["collections.OrderedDict"].__name__ == "OrderedDict"
    assert f"{__name__}._Allowed" not in found
    with torch.serialization.safe_globals([_Allowed]):
        assert _compat.weights_only_globals()[f"{__name__}._Allowed"] is _Allowed


def test_set_element():
    root = {"a": {"b": [0, 1]}}
    _compat.set_element(root, ("a", "b", 1), "x")
    assert root == {"a": {"b": [0, "x"]}}


def test_StorageInfo():
    info = _compat.StorageInfo(relative_path="__0_0.distcp", offset=3, length=5)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 3, 5)


def test_MemoryFormatEncoding():
    assert {e.name for e in _compat.MemoryFormatEncoding} >= {"TORCH_CONTIGUOUS_FORMAT"}


def test_set_num_threads_if_needed(monkeypatch):
    """Sets OMP_NUM_THREADS and torch's threads when unset (as Lightning's launch does before the run)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        _lightning.set_num_threads_if_needed(2)
        assert int(os.environ["OMP_NUM_THREADS"]) >= 1
    finally:
        torch.set_num_threads(threads)
