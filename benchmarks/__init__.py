"""Everything that measures the pipeline: the benchmark driver, its worker and workloads, the tensor-memory
meter, and the process-launch harness the tests share (``benchmarks.launch``)."""
