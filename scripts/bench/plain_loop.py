"""Baseline for flame's throughput: a plain PyTorch training loop on the same HF model.

    python scripts/bench/plain_loop.py --config configs/llama_340M.json --batch 8 --seq 4096 --steps 30

bf16 autocast, fused AdamW, random tokens, one GPU, no flame code in the loop. Prints the
median step time, tokens/s, TFLOPS/MFU (flame's FLOPs count) and peak memory as one line.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from flame.models import load_model_config
from flame.models.flops import flops_per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    args = parser.parse_args()

    config = load_model_config(args.config)
    model = AutoModelForCausalLM.from_config(config).cuda()
    if args.compile:
        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device="cuda")
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    tps = args.batch * args.seq / step_time
    flops = flops_per_token(model, args.seq)
    print(
        f"plain-loop config={args.config} batch={args.batch}x{args.seq} compile={args.compile} "
        f"step={step_time * 1000:.1f}ms tok/s={tps:,.0f} TFLOPS={flops * tps / 1e12:.1f} "
        f"MFU={100 * flops * tps / 989e12:.1f}% peak_mem={torch.cuda.max_memory_reserved() / 2**30:.1f}GiB"
    )


if __name__ == "__main__":
    main()
