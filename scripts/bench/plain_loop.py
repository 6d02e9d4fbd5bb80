"""Baseline for flame's throughput: a plain PyTorch training loop on the same model and data.

    python scripts/bench/plain_loop.py --config configs/gla_340M.json --seq 65536 --steps 30
    python scripts/bench/plain_loop.py --config configs/llama_340M.json --rows 4 --seq 4096
    python scripts/bench/plain_loop.py --config configs/llama_4M.json --seq 512 --steps 2 --warmup 1 --device cpu

One device, fused AdamW, logits + cross entropy, bf16 autocast on CUDA (fp32 on CPU), no flame
training code. The batches are flame.data's (scripts/bench/batches.py: the builtin corpus
packed as the trainer packs it; one row is varlen), handed to the model as the trainer hands
them (flame.models.model_inputs: HF models get position ids and flame's document attention,
fla models one row with cu_seqlens). Prints each step's time to stderr (a first step that
takes minutes shows as fla autotuning); last, one JSON line on stdout: the median step time,
tokens/s at that median, TFLOPS and MFU (flame's FLOPs count) over the timed steps, peak
reserved memory and the model's parameter count. With --profile FILE (CUDA) the last step runs
under torch's profiler and FILE gets where its GPU time went (scripts/bench/trace_summary.py), as
`gpu_check.py --suite profile` keeps it for flame's runs.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.kernels import attention
from flame.models import load_model_config, model_inputs
from flame.models.flops import model_flops
from flame.models.inputs import is_fla_config
from flame.models.registry import decoder_layers
from scripts.bench import trace_summary
from scripts.bench.batches import packed_batches

PEAK_FLOPS = 989e12  # H100/H200 bf16 dense, as flame's MFU


def forward_backward(model, batch: dict, labels: torch.Tensor, device: str) -> torch.Tensor:
    """One batch's forward and backward as flame's trainer hands it to the model (its inputs, the batch's
    documents for the attention kernels), in bf16 autocast on CUDA; returns the loss."""
    ids, targets, kwargs = model_inputs(model, batch, labels)
    with batch_context.computing(BatchContext(cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(ids, **kwargs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    return loss


def train_step(model, optimizer, batch: dict, labels: torch.Tensor, device: str) -> tuple[float, float]:
    """One step from an idle GPU to an idle GPU: its seconds and its loss."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = forward_backward(model, batch, labels, device)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def last_step_profiler(steps: int, folder: str):
    """torch's profiler over the loop, recording its last step (the one before warms the profiler up, as
    torchtitan's schedule does), its Chrome trace written into ``folder``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=max(0, steps - 2), warmup=min(1, steps - 1), active=1),
        on_trace_ready=lambda profiler: profiler.export_chrome_trace(f"{folder}/trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="model config JSON")
    parser.add_argument("--rows", type=int, default=1, help="rows per step (1: one varlen row)")
    parser.add_argument("--seq", type=int, default=65536, help="tokens per row")
    parser.add_argument("--context", type=int, default=4096, help="longest document piece (--training.context_len)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (autotuning, compiling)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="record the last step under torch's profiler; write where its GPU time went to FILE")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.profile and not cuda:
        parser.error("--profile sums the step's GPU kernels: it needs --device cuda")
    if args.profile and not args.profile.parent.is_dir():  # refused before the run, not after it
        parser.error(f"--profile {args.profile}: no folder {args.profile.parent} to write it in; create it first")

    config = load_model_config(args.config)
    options = {} if is_fla_config(config) else {"attn_implementation": attention.HF_ATTENTION}
    model = AutoModelForCausalLM.from_config(config, **options).to(args.device)
    if args.compile:
        layers = decoder_layers(model)
        for index, block in enumerate(list(layers)):
            layers[index] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    flops = model_flops(model)
    batches = packed_batches(args.warmup + args.steps, args.rows, args.seq, args.context, device=args.device)

    times, step_flops = [], []
    # a step's trace is hundreds of MB: only its summary is kept
    with tempfile.TemporaryDirectory() as traces:
        profiler = last_step_profiler(len(batches), traces) if args.profile else contextlib.nullcontext()
        with profiler:
            for step, (batch, labels) in enumerate(batches):
                seconds, loss = train_step(model, optimizer, batch, labels, args.device)
                print(f"step {step + 1}/{len(batches)}: {seconds:.2f} s, loss {loss:.4f}", file=sys.stderr, flush=True)
                if args.profile:
                    profiler.step()
                if step >= args.warmup:
                    times.append(seconds)
                    step_flops.append(flops.batch_flops(batch["cu_seqlens"].diff().tolist()))
        if args.profile:
            args.profile.write_text(trace_summary.summarize(Path(traces) / "trace.json") + "\n")
    step_time = statistics.median(times)
    achieved = sum(step_flops) / sum(times)
    print(json.dumps({
        "config": args.config, "rows": args.rows, "seq": args.seq, "compile": args.compile,
        "params": sum({id(p): p.numel() for p in model.parameters()}.values()),  # tied weights once
        "step_ms": round(step_time * 1000, 1),
        "tokens_per_s": round(args.rows * args.seq / step_time),
        "tflops": round(achieved / 1e12, 1),
        "mfu": round(100 * achieved / PEAK_FLOPS, 1) if cuda else None,
        "peak_mem_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1) if cuda else None,
    }), flush=True)


if __name__ == "__main__":
    main()
