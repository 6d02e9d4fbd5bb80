"""What this machine does per second, for pricing the memory plan's layouts: measured once, cached.

The plan's layouts trade memory for time: recomputing blocks costs matmul time, CPU offload
costs transfers over the host link and an optimizer step on the host, micro-batches cost
efficiency (smaller matmuls), the host's launches once more per pass and, under FSDP, gathering
the weights again. ``probe`` measures
the rates that price them, in about a second:

- matmul TFLOP/s in the compute dtype at several row counts (a ``[M, 4096] x [4096, 4096]``
  product for M from 256 to 16,384): small micro-batches run at the rate of their row count;
- the host link in GB/s (pinned host memory to the GPU and back, the slower direction);
- a host AdamW step in parameters per second (``torch.optim.AdamW``, fused, over fp32 tensors
  on the CPU, as FSDP2's CPU offload steps it with flame's default optimizer);
- the host's time per op launch (PyTorch's dispatch and the kernel launch, one-element adds in
  a row): every pass pays the host's launches, whatever its tokens.

The result is cached per machine (host name, device name, torch version, dtype) under
``$FLAME_CACHE/hardware`` (default ``~/.cache/flame``): train.sh's preflight measures it,
the ranks read the file it wrote, and only a plan that must choose asks for it. The first
process that needs it measures it while holding a lock on the file, so the ranks of a node
never measure side by side. ``FLAME_HARDWARE=<file>`` takes the rates from such a file
instead: copy one node's to the others so that every node of a job prices alike.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flame.base import device
from flame.data import builtin
from flame.base.errors import ConfigError
from flame.base.measured_once import UNREADABLE, measured_once, write

ROWS = (256, 1024, 4096, 16384)  # the matmul rows measured; between them the rate is interpolated in log(M)
WIDTH = 4096  # the matmuls' inner and outer size: a 1B-7B model's hidden size
CPU_ROWS, CPU_WIDTH = (64, 256, 1024), 512  # a CPU measures smaller products: its plans only run in tests
LINK_BYTES = 256 * 2**20  # one copy each way, repeated
ADAM_PARAMS = 16 * 2**20  # fp32 parameters in the host AdamW step measured
LAUNCHES = 2000  # one-element adds in a row: each costs the host's dispatch, not the GPU's time
REPEATS = 5


@dataclass(frozen=True)
class Hardware:
    """The rates that price the plan's layouts (docs/memory-plan.md)."""

    name: str  # the device, as measured
    matmul_tflops: dict[int, float]  # rows -> TFLOP/s of a [rows, WIDTH] x [WIDTH, WIDTH] product, compute dtype
    host_link_gbps: float | None  # GB/s between pinned host memory and the GPU; None on a CPU
    host_adam_params_per_s: float  # a host AdamW step's fp32 parameters per second
    launch_seconds: float  # the host's time to dispatch and launch one small op: a pass of small ops waits on it

    def tflops(self, rows: float) -> float:
        """The matmul rate at ``rows`` rows: interpolated in log(rows) between the measured ones, flat beyond them."""
        sizes = sorted(self.matmul_tflops)
        if rows <= sizes[0]:
            return self.matmul_tflops[sizes[0]]
        if rows >= sizes[-1]:
            return self.matmul_tflops[sizes[-1]]
        above = bisect.bisect_left(sizes, rows)
        low, high = sizes[above - 1], sizes[above]
        share = (math.log(rows) - math.log(low)) / (math.log(high) - math.log(low))
        return self.matmul_tflops[low] + share * (self.matmul_tflops[high] - self.matmul_tflops[low])

    def describe(self) -> str:
        rates = ", ".join(f"{rows}: {tflops:.3g}" for rows, tflops in sorted(self.matmul_tflops.items()))
        link = f"; host link {self.host_link_gbps:.1f} GB/s" if self.host_link_gbps else ""
        return (f"{self.name}: matmul TFLOP/s by rows {{{rates}}}{link}; "
                f"host AdamW {self.host_adam_params_per_s / 1e9:.2f} G params/s; "
                f"{self.launch_seconds * 1e6:.1f} us an op launch")


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(work, repeats: int = REPEATS) -> float:
    """Seconds of one ``work()``, the fastest of ``repeats`` after a warm-up."""
    work()
    best = math.inf
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        work()
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def probe(dtype: torch.dtype) -> Hardware:
    """Measure this machine's rates (about a second on a GPU)."""
    gpu = device.CUDA and torch.cuda.is_available()
    # this rank's GPU: the ranks have not picked theirs yet, and a context on GPU 0 would take its memory
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count() if gpu else 0
    where = torch.device("cuda", local) if gpu else torch.device("cpu")
    rows, width = (ROWS, WIDTH) if gpu else (CPU_ROWS, CPU_WIDTH)
    if not gpu:
        dtype = torch.float32  # a CPU plan computes in fp32 (bf16 matmuls there are no guide to a GPU's)
    weight = torch.randn(width, width, device=where, dtype=dtype)
    tflops = {}
    for count in rows:
        inputs = torch.randn(count, width, device=where, dtype=dtype)
        tflops[count] = 2 * count * width * width / _timed(lambda: inputs @ weight) / 1e12  # noqa: B023 - timed at once
    link = None
    if gpu:
        host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
        on_gpu = torch.empty(LINK_BYTES, dtype=torch.uint8, device=where)
        up = _timed(lambda: on_gpu.copy_(host, non_blocking=True))
        down = _timed(lambda: host.copy_(on_gpu, non_blocking=True))
        link = LINK_BYTES / max(up, down) / 1e9
    params = [torch.zeros(ADAM_PARAMS // 16, 16)]
    params[0].grad = torch.randn_like(params[0])
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the default --optimizer.implementation
    adam = ADAM_PARAMS / _timed(optimizer.step, repeats=3)
    counter = torch.zeros(1, device=where)
    launch = _timed(lambda: [counter.add_(1) for _ in range(LAUNCHES)]) / LAUNCHES
    name = torch.cuda.get_device_name(where) if gpu else f"CPU ({platform.processor() or platform.machine()})"
    return Hardware(name=name, matmul_tflops=tflops, host_link_gbps=link, host_adam_params_per_s=adam,
                    launch_seconds=launch)


def cache_path(dtype: torch.dtype) -> Path:
    root = builtin.cache_dir() / "hardware"
    gpu = torch.cuda.get_device_name(0).replace(" ", "-") if device.CUDA and torch.cuda.is_available() else "cpu"
    return root / f"{platform.node() or 'host'}-{gpu}-torch{torch.__version__}-{str(dtype).removeprefix('torch.')}.json"


def read(path: Path) -> Hardware:
    data = json.loads(path.read_text())
    return Hardware(**{**data, "matmul_tflops": {int(rows): tflops for rows, tflops in data["matmul_tflops"].items()}})


def load(dtype: torch.dtype) -> Hardware:
    """This machine's rates: FLAME_HARDWARE's file, else the cache, else measured now and cached (under a
    lock: one process measures)."""
    if given := os.environ.get("FLAME_HARDWARE"):
        try:
            return read(Path(given))
        except UNREADABLE as error:
            raise ConfigError(f"FLAME_HARDWARE={given} is not a rates file flame wrote ({type(error).__name__}: {error}): "
                              f"point it at one under {cache_path(dtype).parent}, or unset it to measure") from None
    return measured_once(cache_path(dtype), read, lambda: probe(dtype))


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main() -> None:
    """``python -m flame.memory.hardware [bfloat16|float16|float32]``: measure this machine's rates again, cache
    and print them."""
    import sys

    name = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    if name not in DTYPES:
        print(f"flame: error: {name!r} is not a compute dtype: give one of {', '.join(DTYPES)}", file=sys.stderr)
        raise SystemExit(2)
    start = time.perf_counter()
    path = cache_path(DTYPES[name])
    path.parent.mkdir(parents=True, exist_ok=True)
    measured = write(path, probe(DTYPES[name]))
    print(f"{measured.describe()}\nmeasured in {time.perf_counter() - start:.1f} s, cached in {path}")


if __name__ == "__main__":
    main()
