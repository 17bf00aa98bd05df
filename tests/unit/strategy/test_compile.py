"""torch.compile of the pipelined Sequential: each stage is compiled, losses equal the compiled model
on one device."""

import torch

from tests.models import Net


def test_uncompile_finds_the_users_compiled_sequential_and_its_settings():
    from lightning_gpipe.partition.compiling import Uncompiled, compiled_sequentials, uncompile
    from lightning_gpipe.partition.cut import find_sequential

    model = Net("mlp", compile_layers={"backend": "aot_eager", "dynamic": False})
    compiled = model.layers
    assert [attr for _, attr, _ in compiled_sequentials(model)] == ["layers"]
    names = list(model.state_dict())
    undone, compile_like_user = uncompile(model)
    assert isinstance(model.layers, Uncompiled) and model.layers._orig_mod is compiled._orig_mod
    assert list(model.state_dict()) == names  # "layers._orig_mod.0.weight", as the model names them
    assert find_sequential(model) == ("layers._orig_mod", compiled._orig_mod)
    assert find_sequential(model, "layers") == ("layers._orig_mod", compiled._orig_mod)
    x = torch.randn(3, 6)
    assert torch.equal(model.layers(x), compiled._orig_mod(x)) and len(model.layers) == len(compiled)
    recompiled = compile_like_user(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recompiled.dynamo_ctx is compiled.dynamo_ctx  # the same backend, mode, dynamic, options


def test_a_compiled_sequential_inside_the_pipelined_one_keeps_its_names():
    """A layer that is itself a compiled Sequential: uncompiled for fit, its parameters keep the names
    the model gives them on one device (``layers.0._orig_mod.0.weight``) and it computes the same."""
    from lightning_gpipe.partition.compiling import Uncompiled, recompile, uncompile
    from lightning_gpipe.partition.cut import find_sequential

    inner = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), backend="eager")
    model = torch.nn.Module()
    model.layers = torch.nn.Sequential(inner, torch.nn.Linear(8, 2))
    names, x = list(model.state_dict()), torch.randn(3, 4)
    undone, _ = uncompile(model)
    assert isinstance(model.layers[0], Uncompiled) and list(model.state_dict()) == names
    assert find_sequential(model)[0] == "layers"
    assert torch.equal(model.layers(x), model.layers[1](inner._orig_mod(x)))
    recompile(undone)
    assert model.layers[0] is inner and list(model.state_dict()) == names
