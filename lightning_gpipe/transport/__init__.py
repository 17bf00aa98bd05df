"""How tensors move between ranks: point-to-point messages, their header codec, process groups, the
rank layout."""

from lightning_gpipe.transport.layout import Layout
from lightning_gpipe.transport.p2p import P2P
from lightning_gpipe.transport.topology import StageTopology

__all__ = [
    "Layout",
    "P2P",
    "StageTopology",
]
