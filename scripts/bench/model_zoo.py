"""Does each model type train under flame on a GPU? One config per process, one JSON line out.

    python scripts/bench/model_zoo.py configs/tiny/gla.json [--no-compile] >> zoo.jsonl

With flame's own pieces (build_model: flame's attention and fused loss head; model_inputs:
how the family takes packed documents; per-block torch.compile as parallelize_model does),
in bf16 autocast on real packed documents (varlen rows of --tokens 8192 of the builtin corpus):
1. varlen parity: a packed row of 3 documents vs each document alone, logits and gradients;
2. 30 AdamW steps eager: the loss must be finite and fall; tokens/s and peak memory of the last 10;
3. the same with per-block torch.compile (a fresh model, same process: fla's kernels are
   autotuned once), counting graphs compiled after step 5 (recompilations);
4. activation checkpointing as parallelize_model applies it (full, and selective op-level):
   8 steps each from the same init, the largest loss difference from the eager run.
"""

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F
from torchtitan.config.job_config import ActivationCheckpoint

from flame.components.loss import LossHead
from flame.distributed.parallelize import checkpoint_blocks
from flame.models import FlameModelArgs, build_model, load_model_config, model_inputs
from flame.models.registry import decoder_layers
from scripts.bench.packed_data import packed_batches


def build(path: str) -> torch.nn.Module:
    args = FlameModelArgs(config_path=path)
    args._config = load_model_config(path)
    args.fused_cross_entropy = True
    with torch.device("cuda"):
        return build_model(args)


def batch_dict(ids, cu_seqlens, max_seqlen):
    positions = torch.cat([torch.arange(int(n), device=ids.device) for n in cu_seqlens.diff()])[None]
    return {"input": ids, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "position_ids": positions}


def forward_loss(model, ids, labels, cu_seqlens, max_seqlen, fused=True):
    inputs, labels, kwargs = model_inputs(model, batch_dict(ids, cu_seqlens, max_seqlen), labels)
    head = model.get_output_embeddings()
    if fused and isinstance(head, LossHead):
        head.targets = labels
        return model(inputs, **kwargs).logits
    logits = model(inputs, **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"), logits


def parity(model, ids, labels) -> dict:
    """Packed documents vs one at a time: max |logit diff| / max |logit| and gradient rel. error."""
    lengths = [300, 517, 160]
    if ids.shape[1] < sum(lengths):  # a shorter row (--tokens 512): the same shares of its own tokens
        first_two = [n * ids.shape[1] // sum(lengths) for n in lengths[:2]]
        lengths = [*first_two, ids.shape[1] - sum(first_two)]
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    ids, labels = ids[:, : sum(lengths)], labels[:, : sum(lengths)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, packed = forward_loss(model, ids, labels, cu_seqlens, max(lengths), fused=False)
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    separate = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        one = torch.tensor([0, end - start], device="cuda", dtype=torch.int32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            doc_loss, logits = forward_loss(model, ids[:, start:end], labels[:, start:end], one, end - start, fused=False)
        doc_loss.backward()
        separate.append(logits.reshape(1, end - start, -1))
    separate_grads = [p.grad for p in model.parameters() if p.grad is not None]
    separate = torch.cat(separate, 1).float()
    logit_error = ((packed.reshape(separate.shape).float() - separate).abs().max() / separate.abs().max()).item()
    grad_error = max(
        ((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(packed_grads, separate_grads)
    )
    model.zero_grad(set_to_none=True)
    return {"parity_logits": logit_error, "parity_grads": grad_error}


def train(model, batches, compile_blocks: bool = False, ac_mode: str | None = None) -> dict:
    if ac_mode:
        checkpoint_blocks(decoder_layers(model), ActivationCheckpoint(mode=ac_mode, selective_ac_option="op"), False)
    if compile_blocks:
        layers = decoder_layers(model)
        for index, block in enumerate(list(layers)):
            layers[index] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    losses, times, graphs_at_5 = [], [], None
    for step, (ids, labels, cu_seqlens, max_seqlen) in enumerate(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward_loss(model, ids, labels, cu_seqlens, max_seqlen) / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if step == 4:
            graphs_at_5 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            torch.cuda.reset_peak_memory_stats()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    result = {
        "losses": losses,
        "loss_first": first, "loss_last": last,
        "trains": all(math.isfinite(x) for x in losses) and last < first - 0.5,
        "tokens_per_s": batches[0][0].numel() * 10 / sum(times[-10:]),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if compile_blocks:
        result["graphs_compiled_after_step5"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_at_5
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--no-compile", action="store_true", help="skip the compiled run")
    stages.add_argument("--compile-only", action="store_true", help="only the compiled run (for a type whose other stages ran)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per varlen row (shorter for slow scans)")
    args = parser.parse_args()
    result = {"config": args.config}
    stage = "build"

    def emit(done: str) -> None:  # a line after every stage: a run killed at its time limit keeps what finished
        line = {**result, "done": done}
        for mode in ("eager", "compile"):
            if mode in line:
                line[mode] = {k: v for k, v in line[mode].items() if k != "losses"}
        print(json.dumps(line), flush=True)

    try:
        batches = packed_batches(args.tokens, args.steps)
        torch.manual_seed(0)  # every run below starts from these same weights
        model = build(args.config)
        result["model_type"] = model.config.model_type
        result["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        if not args.compile_only:
            stage = "parity"
            result.update(parity(model, *batches[0][:2]))
            emit(stage)
            stage = "eager"
            result["eager"] = train(model, batches, compile_blocks=False)
            emit(stage)
        if not args.no_compile:
            stage = "compile"
            del model
            torch.manual_seed(0)
            result["compile"] = train(build(args.config), batches, compile_blocks=True)
            emit(stage)
        for mode in ("full", "selective") if not args.compile_only else ():
            stage = f"ac {mode}"
            torch.manual_seed(0)
            run = train(build(args.config), batches[:8], ac_mode=mode)
            eager = result["eager"]["losses"][:8]
            result[f"ac_{mode}_max_loss_diff"] = max(abs(a - b) for a, b in zip(run["losses"], eager))
    except Exception as error:  # one line per model, failures included
        result["error"] = f"{stage}: {type(error).__name__}: {str(error)[:300]}"
        result["traceback"] = traceback.format_exc()[-1500:]
    emit("all")


if __name__ == "__main__":
    main()
