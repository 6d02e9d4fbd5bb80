"""Baseline for flame's throughput: a plain PyTorch training loop on the same model and data.

    python scripts/bench/plain_loop.py --config configs/gla_340M.json --varlen 65536 --steps 30
    python scripts/bench/plain_loop.py --config configs/llama_340M.json --batch 4 --seq 4096

bf16 autocast, fused AdamW, one GPU, logits + cross entropy, no flame code in the loop. With
--varlen N each step is one row of N tokens of real packed documents (the builtin corpus,
context 4096; see packed_data.py) with the documents given as the model takes them (HF:
position ids + flame's attention; fla: cu_seqlens); otherwise rows of random tokens.
Prints each step's time to stderr; last, the median step time, tokens/s, TFLOPS/MFU (flame's
FLOPs count) and peak memory.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from flame.models import attention, load_model_config
from flame.models.flops import model_flops
from flame.models.inputs import is_fla_config
from scripts.bench.packed_data import packed_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--varlen", type=int, default=0, help="tokens per row of packed documents (batch 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    args = parser.parse_args()

    config = load_model_config(args.config)
    is_fla = is_fla_config(config)
    options = {} if is_fla else {"attn_implementation": attention.HF_ATTENTION}
    model = AutoModelForCausalLM.from_config(config, **options).cuda()
    if args.compile:
        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    flops = model_flops(model)

    if args.varlen:
        batches = packed_batches(args.varlen, args.warmup + args.steps)
    else:
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device="cuda")
        cu_seqlens = torch.arange(0, args.batch * args.seq + 1, args.seq, device="cuda", dtype=torch.int32)
        batches = [(tokens[:, :-1], tokens[:, 1:], cu_seqlens, args.seq)] * (args.warmup + args.steps)

    times, step_flops = [], []
    for step, (ids, labels, cu_seqlens, max_seqlen) in enumerate(batches):
        lengths = cu_seqlens.diff().tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        attention.use_batch_documents(cu_seqlens, max_seqlen)  # the longest document, for the kernels
        if is_fla:
            kwargs = {"cu_seqlens": cu_seqlens} if args.varlen else {}
        else:
            positions = torch.cat([torch.arange(n, device="cuda") for n in lengths]).view(ids.shape)
            kwargs = {"position_ids": positions, "cu_seq_lens_q": cu_seqlens}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, use_cache=False, **kwargs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # progress on stderr: a first step that takes minutes (fla autotuning) shows as such
        print(f"step {step + 1}/{len(batches)}: {seconds:.2f} s", file=sys.stderr, flush=True)
        if step >= args.warmup:
            times.append(seconds)
            step_flops.append(flops.batch_flops(lengths))
    step_time = statistics.median(times)
    tps = ids.numel() / step_time
    achieved = sum(step_flops) / sum(times)
    shape = f"varlen 1x{args.varlen}" if args.varlen else f"{args.batch}x{args.seq}"
    print(
        f"plain-loop config={args.config} batch={shape} compile={args.compile} "
        f"step={step_time * 1000:.1f}ms tok/s={tps:,.0f} TFLOPS={achieved / 1e12:.1f} "
        f"MFU={100 * achieved / 989e12:.1f}% peak_mem={torch.cuda.max_memory_reserved() / 2**30:.1f}GiB"
    )


if __name__ == "__main__":
    main()
