"""Worker: rank 0 sends messages to rank 1 through lightning_gpipe.transport.p2p.P2P (torchrun-style env).

Usage: python tests/workers/p2p.py OUT MODE
MODE "order": rank 0 sends 6 messages of changing shapes, sizes and dtypes, then 2 more after a barrier;
rank 1 receives them in order;
it writes what it got to OUT/received.pt and rank 0 writes what it sent to OUT/sent.pt, and to
OUT/held.json how many sends it held just after posting the last 2 and once rank 1 had them
(before any flush).
MODE "peer_exits": rank 0 sends 1 of the 3 messages rank 1 waits for, then exits; rank 1 writes
the error its second receive raised (and how long it took) to OUT/error.json.
MODE "lanes" (4 ranks, two pipelines of 2 stages: groups.new_groups): the two ranks of each
pipeline send each other 3 messages at once, and rank 0 sends rank 2
(another pipeline) one; each rank writes to OUT/lanes{rank}.json the group each of its posts and
receives used ("upward", "downward", "default") and whether what it received is what was sent.
MODE "lanes_abort": rank 1 waits for a message from rank 0 on their lane; rank 0 aborts its
process groups as after a failure (failure.abort_process_group) and stays alive until rank 1
has written the error its receive raised and how long it took to OUT/error.json, 12 s at most (a
receive that waited for rank 0's exit would take over 12 s).
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_gpipe.transport.p2p import P2P

out, mode = Path(sys.argv[1]), sys.argv[2]


def record_error(receive) -> None:
    """Write the error ``receive()`` raised (``None``: none) and the seconds it took to
    OUT/error.json, then exit."""
    start = time.monotonic()
    try:
        receive()
        error = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    (out / "error.json").write_text(json.dumps({"error": error, "seconds": time.monotonic() - start}))
    sys.exit(0)


dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
rank = dist.get_rank()
p2p = P2P(torch.device("cpu"))
torch.manual_seed(0)
messages = [
    [torch.randn(3, 4)],
    [torch.randn(150, 128), torch.arange(5)],
    [torch.randn(150, 128), torch.arange(5)],
    [torch.randint(0, 9, (2, 3)), torch.rand(2) > 0.5],
    [torch.randn(8)],
    [torch.randn(2, 2).bfloat16()],
    [torch.randn(150, 128)],
    [torch.randn(6)],
]
if mode == "order":
    if rank == 0:
        for k, m in enumerate(messages[:6]):
            p2p.send(m, 1, chunks=k)
        p2p.flush()
        dist.barrier()
        for k, m in enumerate(messages[6:], start=6):
            p2p.send(m, 1, chunks=k)
        posted = p2p.sends_in_flight()
        dist.barrier()  # rank 1 has received them: their buffers go without a flush
        deadline = time.monotonic() + 20
        while p2p.sends_in_flight() and time.monotonic() < deadline:
            p2p.settle()
            time.sleep(0.01)
        held = {"posted": posted, "held_once_received": p2p.sends_in_flight()}
        p2p.flush()
        torch.save(messages, out / "sent.pt")
        (out / "held.json").write_text(json.dumps(held))
    else:
        got = [p2p.recv(0) for _ in range(6)]
        dist.barrier()
        got += [p2p.recv(0) for _ in range(2)]
        dist.barrier()
        torch.save([(meta.chunks, tensors) for meta, tensors in got], out / "received.pt")
elif mode == "peer_exits":
    if rank == 0:
        p2p.send(messages[0], 1)
        p2p.flush()
        dist.barrier()
        sys.exit(0)
    p2p.recv(0)
    dist.barrier()
    record_error(lambda: p2p.recv(0))
elif mode == "lanes":
    from lightning_gpipe.transport import groups
    from lightning_gpipe.transport import p2p as comm
    from lightning_gpipe.transport.layout import Layout

    lanes = groups.new_groups(Layout(4, 2), rank).lanes
    assert lanes is not None
    p2p = P2P(torch.device("cpu"), lanes=lanes)
    names = {id(lanes.upward): "upward", id(lanes.downward): "downward", id(None): "default"}
    used: dict[str, list[str]] = {"posts": [], "receives": []}
    post, irecv = comm.ops.isend, comm.ops.irecv

    def spy_post(t, dst, group=None, tag=0):
        used["posts"].append(names[id(group)])
        return post(t, dst, group, tag)

    def spy_irecv(t, src, group=None, tag=0):
        used["receives"].append(names[id(group)])
        return irecv(t, src, group, tag)

    comm.ops.isend, comm.ops.irecv = spy_post, spy_irecv
    partner = rank ^ 1
    mine = [[torch.full((64, 32), float(10 * rank + k))] for k in range(3)]
    for m in mine:
        p2p.send(m, partner)
    got = [p2p.recv(partner)[1] for _ in range(3)]
    theirs = [[torch.full((64, 32), float(10 * partner + k))] for k in range(3)]
    if rank == 0:
        p2p.send([torch.arange(4)], 2)
    elif rank == 2:
        got.append(p2p.recv(0)[1])
        theirs.append([torch.arange(4)])
    p2p.flush()
    equal = all(torch.equal(a[0], b[0]) for a, b in zip(got, theirs)) and len(got) == len(theirs)
    (out / f"lanes{rank}.json").write_text(json.dumps({**used, "equal": equal}))
    dist.barrier()
elif mode == "lanes_abort":
    from lightning_gpipe.transport import failure, groups
    from lightning_gpipe.transport.layout import Layout

    p2p = P2P(torch.device("cpu"), lanes=groups.new_groups(Layout(2, 2), rank).lanes)
    dist.barrier()
    if rank == 0:
        time.sleep(1)
        failure.abort_process_group()
        alive_until = time.monotonic() + 12  # alive till rank 1 has its error, 12 s at most
        while not (out / "error.json").exists() and time.monotonic() < alive_until:
            time.sleep(0.05)
        sys.exit(0)
    record_error(lambda: p2p.recv(0))
dist.destroy_process_group()
