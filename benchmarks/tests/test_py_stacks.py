"""benchmarks/py_stacks.py: py-spy's raw stacks read and classed as the BENCHMARKS sections use them."""

from benchmarks.py_stacks import classify, main, read

_LOOP = (
    'process 1:"python -m benchmarks.worker";<module> (benchmarks/worker.py:9);'
    "run_ours (benchmarks/worker.py:200)"
)
_PEER = (
    'process 2:"python -m benchmarks.worker";run_peer (benchmarks/worker.py:532);'
    "Peer.step (benchmarks/worker.py:518)"
)
LINES = [
    f"{_LOOP};ColumnExecutor._backward_one (lightning_gpipe/engine/executor.py:324);"
    "_engine_run_backward (torch/autograd/graph.py:979) 50\n",
    f"{_LOOP};ColumnExecutor._compute (lightning_gpipe/engine/executor.py:260);"
    "Linear.forward (torch/nn/modules/linear.py:134) 30\n",
    f"{_LOOP};Module._call_impl (torch/nn/modules/module.py:1789);"
    "ColumnExecutor._post (lightning_gpipe/engine/executor.py:285);"
    "P2P.send (lightning_gpipe/transport/p2p.py:171);isend (torch/distributed/distributed_c10d.py:2652) 7\n",
    f"{_LOOP};P2P.recv (lightning_gpipe/transport/p2p.py:228);"
    "_wait (lightning_gpipe/transport/p2p.py:466) 5\n",
    f"{_LOOP};SGD.step (torch/optim/sgd.py:127);_single_tensor_sgd (torch/optim/sgd.py:379) 2\n",
    f"{_LOOP};ColumnExecutor._advance (lightning_gpipe/engine/executor.py:160) 6\n",
    f"{_PEER};_batch_p2p (torch/distributed/pipelining/schedules.py:643);"
    "irecv (torch/distributed/distributed_c10d.py:2709) 4\n",
    'process 3:"python benchmarks/benchmark.py";<module> (benchmarks/benchmark.py:72) 99\n',
    "not a stack line\n",
]


def test_each_sample_of_a_training_loop_falls_into_its_first_matching_class():
    stacks = read(LINES)
    assert [n for _, n in stacks] == [50, 30, 7, 5, 2, 6, 4, 99]
    assert [classify(frames) for frames, _ in stacks] == [
        "layers",  # the autograd engine
        "layers",  # a layer's own forward, under the executor's call
        "send",  # Module's call machinery is not a layer
        "receive",
        "optimizer",
        "other",
        "receive",  # the peer's irecv
        None,  # not a stage process's loop
    ]


def test_main_prints_each_class_share(tmp_path, capsys):
    path = tmp_path / "raw.txt"
    path.write_text("".join(LINES))
    main([str(path)])
    out = capsys.readouterr().out
    assert (
        "104 samples" in out
        and "layers           80  76.92 %" in out
        and "send              7   6.73 %" in out
    )
