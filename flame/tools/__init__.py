"""Tools around training runs: curves (plot), pretokenizing (preprocess), the loader's throughput (loader_bench)."""
