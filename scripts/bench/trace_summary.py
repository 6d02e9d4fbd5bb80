"""Where a training step's GPU time goes, from a torch profiler trace (Chrome JSON).

    python -m scripts.bench.trace_summary <dump>/profile_traces/iteration_10/rank0_trace.json

train.sh writes such a trace with `--profiling.enable_profiling --profiling.profile_freq N`
(torchtitan's profiler: the N-th step of every N); `scripts/gpu_check.py --suite profile`
runs that and keeps this summary beside each run's log. The summary sums the GPU kernels by
kind (matmuls, attention, fla's Triton kernels, norms, ...; the first pattern that matches a
kernel's name decides), and measures how long the GPU had nothing to run: the time between the
profiled step's first kernel and its last that no kernel covers, which is where the host (Python,
launches, synchronizations, the data) held the GPU back. Under data parallelism it also measures
the time in which only collectives ran: an NCCL kernel lasts until every rank has joined it, so
this is the communication nothing hid plus this rank's wait for slower ones.

Then the host's side of that idle time:
- *host waits*: the CUDA runtime calls in which the host blocked on the GPU (stream, device or
  event synchronizations; ``.item()``, ``.tolist()`` and plain copies to the GPU come down to
  them), summed by the host op that made them;
- *idle before launches*: every stretch in which the GPU had nothing to run, charged to the host
  op that launched the kernel ending it: the op the GPU waited for.
A host op here is the outermost one recorded around the call, with the innermost after ``>``
(``Optimizer.step#AdamW.step > aten::_fused_adamw_``).
"""

import argparse
import bisect
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

COMMUNICATION = "communication (NCCL)"
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
    (COMMUNICATION, r"nccl"),
    ("memory copies and fills", r"memcpy|memset"),
    ("other PyTorch ops", r""),
)
TOP = 12  # the kernels listed by time
HOST_TOP = 8  # the host ops listed, for waits and for idle time
# CUDA runtime calls that block the host until the GPU has finished earlier work
SYNCS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")
MIN_GAP_US = 5  # shorter stretches without a kernel are the launches' own spacing


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


class HostOps:
    """The host ops recorded on each thread, nested, to find the ones around a runtime call quickly."""

    def __init__(self, trace: dict):
        self.threads: dict[tuple, tuple[list[float], list[dict]]] = {}
        by_thread: dict[tuple, list[dict]] = defaultdict(list)
        for event in trace.get("traceEvents", []):  # the step's own annotation holds everything: left out
            if (event.get("ph") == "X" and event.get("cat") in ("cpu_op", "user_annotation", "python_function")
                    and not str(event.get("name", "")).startswith("ProfilerStep#")):
                by_thread[(event["pid"], event["tid"])].append(event)
        for thread, ops in by_thread.items():
            ops.sort(key=lambda op: (op["ts"], -op["dur"]))
            open_ops: list[dict] = []
            for op in ops:
                while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= op["ts"]:
                    open_ops.pop()
                op["parent"] = open_ops[-1] if open_ops else None
                open_ops.append(op)
            self.threads[thread] = ([op["ts"] for op in ops], ops)

    def around(self, call: dict) -> str:
        """The outermost and innermost host ops around ``call`` on its thread, as ``outer > inner``."""
        starts, ops = self.threads.get((call["pid"], call["tid"]), ([], []))
        index = bisect.bisect_right(starts, call["ts"]) - 1
        op, stop = (ops[index] if index >= 0 else None), call["ts"] + call.get("dur", 0)
        while op is not None and op["ts"] + op["dur"] < stop:
            op = op["parent"]
        if op is None:
            return "(no host op recorded)"
        inner = op["name"]
        while op["parent"] is not None:
            op = op["parent"]
        return op["name"] if op["name"] == inner else f"{op['name']} > {inner}"


def host_side(trace: dict, events: list[dict]) -> list[str]:
    """The host waits and the GPU's idle time by the host op behind them (see the module's docstring)."""
    host_ops = HostOps(trace)
    calls = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    waits: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for call in calls:
        if SYNCS.search(call["name"]):
            entry = waits[host_ops.around(call)]
            entry[0] += call["dur"]
            entry[1] += 1
    launches = {call["args"]["correlation"]: call for call in calls if "correlation" in call.get("args", {})}
    idle: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = None
    for event in sorted(events, key=lambda e: e["ts"]):
        if end is not None and event["ts"] - end >= MIN_GAP_US:
            launch = launches.get(event.get("args", {}).get("correlation"))
            entry = idle[host_ops.around(launch) if launch else "(launch not recorded)"]
            entry[0] += event["ts"] - end
            entry[1] += 1
        end = event["ts"] + event["dur"] if end is None else max(end, event["ts"] + event["dur"])
    lines = []
    for title, table in (("host waits (ms, calls, host op)", waits),
                         (f"idle before launches of {MIN_GAP_US} us or more (ms, stretches, host op that launched "
                          "the kernel after)", idle)):
        total = sum(time for time, _ in table.values())
        lines.append(f"{title}: {total / 1e3:.1f} ms in all")
        for name, (time, count) in sorted(table.items(), key=lambda item: -item[1][0])[:HOST_TOP]:
            lines.append(f"  {time / 1e3:8.2f} {count:6d}  {name[:120]}")
    return lines


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
    computing = []  # every kernel but the collectives
    for event in events:
        name, kind = event["name"], kind_of(event["name"])
        for table in (by_kind[kind], by_name[name]):
            table[0] += event["dur"]
            table[1] += 1
        if kind != COMMUNICATION:
            computing.append(event)
    kernels = sum(time for time, _ in by_kind.values())
    lines = [f"{path}: {steps or 'no'} profiled step{'s' if steps != 1 else ''}, {span / 1e3:.1f} ms from the first "
             f"GPU kernel to the last; the GPU busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), idle "
             f"{(span - busy) / 1e3:.1f} ms",
             f"{'kind':32s} {'ms':>9s} {'of kernels':>10s} {'launches':>9s}"]
    if len(computing) < len(events):  # under data parallelism: the collectives no computation overlapped
        alone = busy - busy_time(computing)
        lines.insert(1, f"communication alone (NCCL kernels and nothing else, including their wait for the other ranks): "
                        f"{alone / 1e3:.1f} ms ({100 * alone / span:.1f}%)")
    for kind, (time, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        lines.append(f"{kind:32s} {time / 1e3:9.2f} {100 * time / kernels:9.1f}% {count:9d}")
    lines.append(f"the {TOP} longest kernels (ms, launches, kind, name):")
    for name, (time, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP]:
        lines.append(f"  {time / 1e3:8.2f} {count:6d}  {kind_of(name):28s} {name[:100]}")
    return "\n".join(lines + host_side(trace, events))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.trace_summary", description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path, help="a torch profiler trace (rank<N>_trace.json)")
    args = parser.parse_args(argv)
    print(summarize(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
