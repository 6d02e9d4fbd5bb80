"""Where a training step's GPU time goes, from a torch profiler trace (Chrome JSON).

    python -m scripts.bench.trace_summary <dump>/profile_traces/iteration_10/rank0_trace.json

train.sh writes such a trace with `--profiling.enable_profiling --profiling.profile_freq N`
(torchtitan's profiler: the N-th step of every N); `scripts/gpu_check.py --suite profile`
runs that and keeps this summary beside each run's log. The summary sums the GPU kernels by
kind (matmuls, attention, fla's Triton kernels, norms, ...; the first pattern that matches a
kernel's name decides), and measures how long the GPU had nothing to run: the time between the
profiled step's first kernel and its last that no kernel covers, which is where the host (Python,
launches, synchronizations, the data) held the GPU back.
"""

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# (kind, pattern over the kernel's name), first match wins: inductor's fused kernels before the ops
# they fuse, fla's kernels before the norms and activations they also implement
KINDS = (
    ("compiled (inductor's Triton)", r"^triton_(poi|red|per|tem)_"),
    ("attention (flash)", r"flash|fmha|attn"),  # before matmuls: FlashAttention 3's kernels are CUTLASS templates
    ("matmuls (cuBLAS, CUTLASS)", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("fla Triton kernels", r"^chunk_|^fused_recurrent|^parallel_|^fused_chunk|recompute_w_u|prepare_wy|solve_tril|"
                           r"merge_16x16|l2norm|causal_conv|cumsum|_state_passing|_bmm_chunk|_chunk_"),
    ("norms", r"norm|rowwisemoments"),
    ("activations (SwiGLU, SiLU)", r"swiglu|silu|swish|act_and_mul|gelu"),
    ("rotary embeddings", r"rotary"),
    ("loss", r"cross_entropy|log_softmax|softmax|nll_loss"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("communication (NCCL)", r"nccl"),
    ("memory copies and fills", r"memcpy|memset"),
    ("other PyTorch ops", r""),
)
TOP = 12  # the kernels listed by time


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next(kind for kind, pattern in KINDS if re.search(pattern, lowered))


def gpu_events(trace: dict) -> list[dict]:
    """The trace's GPU work: kernels, copies and fills (complete events with a duration)."""
    return [event for event in trace.get("traceEvents", [])
            if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def busy_time(events: list[dict]) -> float:
    """Microseconds that at least one kernel covers (kernels on several streams overlap)."""
    busy, end = 0.0, None
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def summarize(path: Path) -> str:
    trace = json.loads(path.read_text())
    events = gpu_events(trace)
    if not events:
        raise SystemExit(f"trace_summary: error: {path} holds no GPU kernels: it was recorded without CUDA activity "
                         "(train.sh's --profiling.enable_profiling on a GPU records them)")
    steps = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"))
    first = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - first
    busy = busy_time(events)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        name = event["name"]
        for table in (by_kind[kind_of(name)], by_name[name]):
            table[0] += event["dur"]
            table[1] += 1
    kernels = sum(time for time, _ in by_kind.values())
    lines = [f"{path}: {steps or 'no'} profiled step{'s' if steps != 1 else ''}, {span / 1e3:.1f} ms from the first "
             f"GPU kernel to the last; the GPU busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), idle "
             f"{(span - busy) / 1e3:.1f} ms",
             f"{'kind':32s} {'ms':>9s} {'of kernels':>10s} {'launches':>9s}"]
    for kind, (time, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        lines.append(f"{kind:32s} {time / 1e3:9.2f} {100 * time / kernels:9.1f}% {count:9d}")
    lines.append(f"the {TOP} longest kernels (ms, launches, kind, name):")
    for name, (time, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP]:
        lines.append(f"  {time / 1e3:8.2f} {count:6d}  {kind_of(name):28s} {name[:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.trace_summary", description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path, help="a torch profiler trace (rank<N>_trace.json)")
    args = parser.parse_args(argv)
    print(summarize(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
