"""Benchmarks: the load generator, the experiments, perf_analyzer sweeps and plots (perf/README.md)."""
