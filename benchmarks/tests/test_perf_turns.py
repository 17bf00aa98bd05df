from collections import Counter

import pytest

from benchmarks.perf_turns import category, parse, per_step

LINES = [
    # ours' window [10.0, 10.5]: main thread, 2 ms of sgemm and 1 ms of Python; a Gloo thread's epoll_wait
    "          python 100/100 10.100000:    1000000 cpu-clock:"
    "      7f01 mkl_blas_def_sgemm_kernel_0_zen (/x/lib/libtorch_cpu.so)",
    "          python 100/100 10.200000:    1000000 cpu-clock:"
    "      7f02 mkl_blas_def_sgemm_kernel_0_zen (/x/lib/libtorch_cpu.so)",
    "          python 100/100 10.300000:    1000000 cpu-clock:"
    "      7f03 _PyEval_EvalFrameDefault (/y/libpython3.11.so.1.0)",
    "   gloo_tcp_loop 100/107 10.400000:          1       syscalls:sys_enter_epoll_wait:"
    "      7f04 epoll_wait (/z/libc.so.6)",
    # between the windows: not counted
    "          python 100/100 10.700000:    1000000 cpu-clock:"
    "      7f05 _PyEval_EvalFrameDefault (/y/libpython3.11.so.1.0)",
    # the peer's two windows [11.0, 11.5] and [12.0, 12.5]: 3 ms in the kernel on the main thread
    "          python 100/100 11.100000:    3000000 cpu-clock:"
    "  ffffffff8101 clear_page_erms ([kernel.kallsyms])",
    "          python 100/100 12.100000:    3000000 cpu-clock:"
    "  ffffffff8102 clear_page_erms ([kernel.kallsyms])",
    "not a sample line",
]
WINDOWS = {"ours": [[10.0, 10.5]], "peer": [[11.0, 11.5], [12.0, 12.5]]}


def test_samples_are_summed_per_window_kind_and_thread_per_timed_step():
    samples = parse(LINES)
    assert len(samples) == 7
    assert samples[3].comm == "gloo_tcp_loop" and samples[3].tid == 107 and samples[3].dso == "libc.so.6"
    table = per_step(samples, WINDOWS)
    assert table[("ours", 100, 100, "main")] == Counter(gemm=pytest.approx(2.0), python=pytest.approx(1.0))
    assert table[("ours", 100, 107, "gloo_tcp_loop")] == Counter({"#epoll_wait": 1.0})
    assert table[("peer", 100, 100, "main")] == Counter(kernel=pytest.approx(3.0))  # 6 ms over 2 steps
    assert set(table) == {
        ("ours", 100, 100, "main"),
        ("ours", 100, 107, "gloo_tcp_loop"),
        ("peer", 100, 100, "main"),
    }


@pytest.mark.parametrize(
    ("sym", "dso", "expected"),
    [
        ("mkl_blas_def_sgemm_scopy_down16_bdz", "libtorch_cpu.so", "gemm"),
        ("at::native::add_kernel", "libtorch_cpu.so", "torch"),
        ("_PyEval_EvalFrameDefault", "libpython3.11.so.1.0", "python"),
        ("py::f", "perf-123.map", "python"),
        ("do_epoll_wait", "[kernel.kallsyms]", "kernel"),
        ("__memmove_avx_unaligned", "libc.so.6", "libc"),
        ("gloo::transport::tcp::Loop::run", "libgloo.so", "other"),
    ],
)
def test_category(sym, dso, expected):
    assert category(sym, dso) == expected
