"""Tools around the library: the benchmark, the autotuner, affinity binding, the rank launcher and test helpers."""
