"""Data loader throughput: tokens/s of flame's loader for several worker counts, as a table.

    python -m flame.tools.loader_bench --workers 1,4,16 --batches 200 -- --job.config_file configs/debug.toml

Everything after ``--`` is a training job config (dataset, tokenizer, seq_len, batch_size,
...): the benchmark runs that job's loader for one data-parallel rank, without a model.
It times ``--batches`` batches after a warm-up of two batches per worker and prints tokens/s
in total and per worker. A GPU step consuming T tokens/s needs the total comfortably above T.
"""

import argparse
import sys
import time

from flame.prepare import settled
from flame.data.loader import build_dataloader
from flame.data.tokenizer import load_tokenizer
from flame.base.errors import ConfigError


def measure(job_config, workers: int, batches: int) -> float:
    """Tokens per second of one rank's loader with ``workers`` workers."""
    job_config.training.dataloader.num_workers = workers
    job_config.training.dataloader.prefetch_factor = 4 if workers else None
    loader = build_dataloader(1, 0, load_tokenizer(job_config.model.tokenizer_path), job_config)
    batch_tokens = job_config.training.local_batch_size * job_config.training.seq_len
    iterator = iter(loader)
    for _ in range(2 * max(1, workers)):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="0,1,2", help="comma list of worker counts (0 = in the main process)")
    parser.add_argument("--batches", type=int, default=100, help="batches timed per worker count")
    parser.add_argument("job", nargs=argparse.REMAINDER, help="-- followed by the training job's flags")
    args = parser.parse_args(argv)
    job_args = args.job[1:] if args.job[:1] == ["--"] else args.job
    try:
        counts = [int(w) for w in args.workers.split(",")]
        rows = []
        for workers in counts:
            tokens_per_second = measure(settled(job_args), workers, args.batches)
            rows.append((workers, tokens_per_second))
    except (ConfigError, ValueError) as error:
        print(f"bench: error: {error}", file=sys.stderr)
        return 2
    print(f"{'workers':>8} {'tokens/s':>12} {'tokens/s/worker':>16}")
    for workers, tokens_per_second in rows:
        print(f"{workers:>8} {tokens_per_second:>12,.0f} {tokens_per_second / max(1, workers):>16,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
