"""Where --optimizer.on_host's time goes: one model, one process, the same batches under each setting.

    python scripts/bench/host_optimizer.py --config configs/transformer_1B.json --seq 32768 --ac-blocks 15 \
        --gpu-blocks 4 6

Runs, in turn: torch's fused AdamW on the GPU; flame's host optimizer (flame.optim.host)
with its default threads, with the ones --threads lists, and with the state of the first K blocks
kept on the GPU for each K of --gpu-blocks; each without activation checkpointing and with full AC
of the first --ac-blocks blocks. Per setting, one JSON line: the median step and,
per step, how long the forward waited for the host (waited), the host's AdamW (stepping), and the
host thread's wait for the gradients (copying). Each step's forward and
backward are scripts/bench/plain_loop.py's (bf16 autocast, flame's batches and model inputs).
"""

import argparse
import json
import statistics
import sys
import time

import torch
from torchtitan.config import ActivationCheckpoint
from transformers import AutoModelForCausalLM

from flame.optim.host import HostAdamW
from flame.distributed.parallelize import checkpoint_blocks
from flame.models.kernels import attention
from flame.models import load_model_config
from flame.models.inputs import is_fla_config
from flame.models.registry import decoder_layers
from scripts.bench.batches import packed_batches
from scripts.bench.plain_loop import forward_backward


def timed_steps(model, optimizer, batches, warmup: int) -> list[float]:
    """Seconds from one step's gradient clipping to the next's: the trainer's own host sync is there (its
    check of the gradient norm), so the host optimizer's step overlaps the next forward as in a run."""
    times, last = [], None
    for step, (batch, labels) in enumerate(batches):
        forward_backward(model, batch, labels, "cuda")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.synchronize()
        now = time.perf_counter()
        if last is not None and step > warmup:
            times.append(now - last)
        last = now
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq", type=int, default=32768, help="tokens of the one varlen row a step")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ac-blocks", type=int, default=0, help="also run with full AC of the first N blocks")
    parser.add_argument("--threads", type=int, nargs="*", default=[], help="host thread counts to try besides the default")
    parser.add_argument("--gpu-blocks", type=int, nargs="*", default=[],
                        help="also run with the embeddings' and first K blocks' state on the GPU, for each K")
    args = parser.parse_args()

    config = load_model_config(args.config)
    options = {} if is_fla_config(config) else {"attn_implementation": attention.HF_ATTENTION}
    model = AutoModelForCausalLM.from_config(config, **options).cuda()
    batches = packed_batches(args.warmup + args.steps, 1, args.seq, args.context, device="cuda")
    settings = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    for ac in ([0, args.ac_blocks] if args.ac_blocks else [0]):
        if ac:
            checkpoint_blocks(decoder_layers(model), _full_ac(ac), model_compile_enabled=False)
        runs = [(None, 0), ("gpu", 0), *((threads, 0) for threads in args.threads),
                *((None, blocks) for blocks in args.gpu_blocks)]
        for threads, gpu_blocks in runs:
            torch.cuda.reset_peak_memory_stats()
            if threads == "gpu":
                optimizer = torch.optim.AdamW(model.parameters(), **settings, fused=True)
            else:
                optimizer = HostAdamW(model, **settings, host_threads=threads, gpu_blocks=gpu_blocks)
            times = timed_steps(model, optimizer, batches, args.warmup)
            if threads != "gpu":
                optimizer.settle()  # the last step still writes the weights: before its hooks go
            row = {"ac_blocks": ac, "optimizer": "AdamW on the GPU" if threads == "gpu" else "host",
                   "threads": None if threads == "gpu" else optimizer.host_threads, "gpu_blocks": gpu_blocks,
                   "step_ms": round(1000 * statistics.median(times), 1),
                   "tokens_per_s": round(args.seq / statistics.median(times)),
                   "peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1)}
            if threads != "gpu":
                row.update({f"{name}_ms": round(1000 * getattr(optimizer, name) / len(batches), 1)
                            for name in ("waited", "stepping", "copying")})
                for hook in optimizer.hooks:
                    hook.remove()
            print(json.dumps(row), flush=True)
            del optimizer
            torch.cuda.empty_cache()
        print(f"done: AC of {ac} blocks", file=sys.stderr, flush=True)


def _full_ac(blocks: int) -> ActivationCheckpoint:
    ac = ActivationCheckpoint(mode="full")
    ac.blocks = blocks  # flame's field (flame.config.job): full AC of the first N blocks
    return ac


if __name__ == "__main__":
    main()
