"""Tests of the benchmark tools (run on demand: python -m pytest benchmarks/tests)."""
