"""Does a model type train under flame? One config per process, one JSON line out.

    python -m scripts.bench.model_zoo configs/tiny/gla.json [--no-compile] >> zoo.jsonl
    python -m scripts.bench.model_zoo configs/tiny/llama.json --no-compile --steps 12 --device cpu

With flame's own pieces (build_model: flame's attention and fused loss head; model_inputs:
how the family takes packed documents; per-block torch.compile and activation checkpointing
as parallelize_model applies them), bf16 autocast on CUDA, on flame.data's batches (varlen
rows of --tokens 8192 of the builtin corpus, scripts/bench/batches.py):
1. varlen parity: a packed row of 3 documents vs each document alone, logits and gradients;
2. --steps (30) AdamW steps eager: the loss must be finite and fall; tokens/s and peak memory
   of the last 10;
3. the same with per-block torch.compile (a fresh model, same process: fla's kernels are
   autotuned once), counting graphs compiled after step 5 (recompilations);
4. activation checkpointing as parallelize_model applies it (full, and selective op-level):
   8 steps each from the same init, the largest loss difference from the eager run.
A JSON line is printed after every stage, so a run stopped at its time limit keeps what finished.
"""

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F
from torchtitan.config.job_config import ActivationCheckpoint

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.loss import LossHead
from flame.distributed.parallelize import checkpoint_blocks
from flame.models import load_model_config, model_inputs
from flame.models.builder import FlameModelArgs, build_model
from flame.models.registry import decoder_layers
from scripts.bench.batches import packed_batches

PARITY_DOCUMENTS = [300, 517, 160]  # token counts of the parity stage's three documents


def build(path: str, device: str) -> torch.nn.Module:
    args = FlameModelArgs(config_path=path)
    args._config = load_model_config(path)
    args.fused_cross_entropy = True
    with torch.device(device):
        return build_model(args)


def summed_loss(model, batch: dict, labels: torch.Tensor):
    """The batch's summed cross entropy, and its logits (None when the fused loss head computed it).

    Call it, and the loss's backward, inside the batch's context (``batch_of``), as flame's
    trainer does: attention finds the batch's documents there, activation checkpointing's
    recompute reuses the masks the forward built, and a fused loss head finds its targets.
    """
    inputs, labels, kwargs = model_inputs(model, batch, labels)
    output = model(inputs, **kwargs).logits
    if output.ndim == 0:  # the fused loss head's summed loss
        return output, None
    return F.cross_entropy(output.flatten(0, 1).float(), labels.flatten(), reduction="sum"), output


def batch_of(model, batch: dict, labels: torch.Tensor, fused: bool = True) -> BatchContext:
    """The batch's context as flame's trainer makes it: its documents, and the targets of a fused loss head."""
    fused = fused and isinstance(model.get_output_embeddings(), LossHead)
    return BatchContext(cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"], targets=labels if fused else None)


def documents_batch(ids: torch.Tensor, lengths: list[int]) -> dict:
    """``ids`` [1, sum(lengths)] as a batch of documents of these lengths."""
    cu_seqlens = torch.tensor([0, *lengths], device=ids.device).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]
    return {"input": ids, "position_ids": positions, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)}


def parity(model, ids: torch.Tensor, device: str) -> dict:
    """Packed documents vs one at a time: max |logit diff| / max |logit| and gradient rel. error."""
    lengths = PARITY_DOCUMENTS
    if ids.shape[1] <= sum(lengths):  # a shorter row (--tokens 512): the same shares of its own tokens
        first_two = [n * (ids.shape[1] - 1) // sum(lengths) for n in lengths[:2]]
        lengths = [*first_two, ids.shape[1] - 1 - sum(first_two)]
    ids, labels = ids[:, : sum(lengths)], ids[:, 1 : sum(lengths) + 1]
    packed_batch = documents_batch(ids, lengths)
    with batch_context.computing(batch_of(model, packed_batch, labels, fused=False)):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, packed = summed_loss(model, packed_batch, labels)
        loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    separate = []
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        document = documents_batch(ids[:, piece], [length])
        with batch_context.computing(batch_of(model, document, labels[:, piece], fused=False)):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                doc_loss, logits = summed_loss(model, document, labels[:, piece])
            doc_loss.backward()
        separate.append(logits.reshape(1, length, -1))
        start += length
    separate_grads = [p.grad for p in model.parameters() if p.grad is not None]
    separate = torch.cat(separate, 1).float()
    logit_error = ((packed.reshape(separate.shape).float() - separate).abs().max() / separate.abs().max()).item()
    grad_error = max(
        ((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(packed_grads, separate_grads)
    )
    model.zero_grad(set_to_none=True)
    return {"parity_logits": logit_error, "parity_grads": grad_error}


def train(model, batches, device: str, compile_blocks: bool = False, ac_mode: str | None = None) -> dict:
    cuda = device == "cuda"
    if ac_mode:
        ac = ActivationCheckpoint(mode=ac_mode, selective_ac_option="op")
        ac.blocks = None  # flame's own field of the section (flame.config.job): every block
        checkpoint_blocks(decoder_layers(model), ac, False)
    if compile_blocks:
        layers = decoder_layers(model)
        for index, block in enumerate(list(layers)):
            layers[index] = torch.compile(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    losses, times, graphs_at_5 = [], [], None
    for step, (batch, labels) in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with batch_context.computing(batch_of(model, batch, labels)):  # forward, and backward's recompute
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                loss = summed_loss(model, batch, labels)[0] / (labels != -100).sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if step == 4:
            graphs_at_5 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    timed = times[-10:]
    result = {
        "losses": losses,
        "loss_first": first, "loss_last": last,
        "trains": all(math.isfinite(x) for x in losses) and last < first - 0.5,
        "tokens_per_s": batches[0][1].numel() * len(timed) / sum(timed),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    if compile_blocks:
        result["graphs_compiled_after_step5"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_at_5
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--no-compile", action="store_true", help="skip the compiled run")
    stages.add_argument("--compile-only", action="store_true", help="only the compiled run (for a type whose other stages ran)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per stage (at least 8)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per varlen row (shorter for slow scans)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.steps < 8:
        parser.error(f"--steps {args.steps}: the AC stage compares 8 steps; give at least 8")
    result = {"config": args.config}
    stage = "build"

    def emit(done: str) -> None:  # a line after every stage: a run killed at its time limit keeps what finished
        line = {**result, "done": done}
        for mode in ("eager", "compile"):
            if mode in line:
                line[mode] = {k: v for k, v in line[mode].items() if k != "losses"}
        print(json.dumps(line), flush=True)

    try:
        batches = packed_batches(args.steps, 1, args.tokens, device=args.device)
        torch.manual_seed(0)  # every run below starts from these same weights
        model = build(args.config, args.device)
        result["model_type"] = model.config.model_type
        result["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        if not args.compile_only:
            stage = "parity"
            result.update(parity(model, batches[0][0]["input"], args.device))
            emit(stage)
            stage = "eager"
            result["eager"] = train(model, batches, args.device)
            emit(stage)
        if not args.no_compile:
            stage = "compile"
            del model
            torch.manual_seed(0)
            result["compile"] = train(build(args.config, args.device), batches, args.device, compile_blocks=True)
            emit(stage)
        for mode in ("full", "selective") if not args.compile_only else ():
            stage = f"ac {mode}"
            torch.manual_seed(0)
            run = train(build(args.config, args.device), batches[:8], args.device, ac_mode=mode)
            eager = result["eager"]["losses"][:8]
            result[f"ac_{mode}_max_loss_diff"] = max(abs(a - b) for a, b in zip(run["losses"], eager))
    except Exception as error:  # one line per model, failures included
        result["error"] = f"{stage}: {type(error).__name__}: {str(error)[:300]}"
        result["traceback"] = traceback.format_exc()[-1500:]
    emit("all")


if __name__ == "__main__":
    main()
