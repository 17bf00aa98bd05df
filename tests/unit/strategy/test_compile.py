"""torch.compile of the pipelined Sequential: each stage is compiled, losses equal the compiled model
on one device."""

import torch

from tests.models import Net


def test_uncompile_finds_the_users_compiled_sequential_and_its_settings():
    from lightning_gpipe.partition.compiling import compiled_sequentials, uncompile

    model = Net("mlp", compile_layers={"backend": "aot_eager", "dynamic": False})
    compiled = model.layers
    assert [attr for _, attr, _ in compiled_sequentials(model)] == ["layers"]
    undone, compile_like_user = uncompile(model)
    assert isinstance(model.layers, torch.nn.Sequential) and model.layers is compiled._orig_mod
    recompiled = compile_like_user(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recompiled.dynamo_ctx is compiled.dynamo_ctx  # the same backend, mode, dynamic, options
