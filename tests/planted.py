"""Checkpoints with a pickled payload planted in one file each: a full file, ``lightning_meta.pt``,
``.metadata``, a non-tensor entry of a shard (issue 41, item 1). Each ``plant_*(directory, marker)``
writes one and returns ``(checkpoint path, the file holding the payload)``; the payload, if ever
unpickled, writes ``marker``."""

import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_gpipe.state.sharded import _FLAT, META_FILE, SHARDED_KEY, save_sharded
from tests.models import Net


class Payload:
    """Unpickling this writes a marker file: what a malicious checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def module_and_optimizer():
    module = Net("mlp")
    return module, module.configure_optimizers()


def _sharded(path):
    module, optimizer = module_and_optimizer()
    save_sharded({"global_step": 3, "loops": {"x": 1}}, path, module, [optimizer])
    return path


def plant_full(tmp_path, marker):
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": Net("mlp").state_dict(), "hyper_parameters": {"x": Payload(marker)}}, path)
    return path, path


def plant_meta(tmp_path, marker):
    path = _sharded(tmp_path / "s.ckpt")
    torch.save({SHARDED_KEY: True, "loops": Payload(marker)}, path / META_FILE)
    return path, path / META_FILE


def plant_metadata(tmp_path, marker):
    path = _sharded(tmp_path / "s.ckpt")
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    return path, path / ".metadata"


def plant_entry(tmp_path, marker):
    """A shard whose entry for the optimizer's learning rate (a non-tensor) is the payload."""
    path = _sharded(tmp_path / "s.ckpt")
    module, optimizer = module_and_optimizer()
    flat = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    key = next(k for k, v in flat.items() if k.endswith(".lr"))
    flat[key] = Payload(marker)
    dcp.save({"model": module.state_dict(), "optimizers": [flat]}, checkpoint_id=str(path))
    return path, path / "__0_0.distcp"


PLANTS = [plant_full, plant_meta, plant_metadata, plant_entry]
