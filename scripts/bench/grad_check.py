"""Are a model's gradients reproducible on this GPU, and where are they large? One GPU, no flame training loop.

    python scripts/bench/grad_check.py --config configs/gla_340M.json --tokens 65536 --repeats 3

Why: in flame's 340M gla runs on H200s (docs/perf-log-archive.md, session 11) the gradient norm of the
same rows differed by 200x between two layouts at step 1 (3,856 against 17.8), while the
transformer's stayed smooth. This separates the suspects without flame's loop: the model is
built once (seeded), its parameters cast to --dtype (as FSDP's mixed precision does; or kept
in fp32 under bf16 autocast with --autocast, as flame on one GPU), and the same real packed
rows (packed_data.py) go through forward and backward --repeats times, without an optimizer
step. One JSON line per pass: the loss, the total gradient norm, and
the five largest gradient norms by module (decoder blocks split into their children). Equal
lines across repeats = deterministic; a norm that changes between repeats of one input
points at the kernels, not at flame. --attn-mode compares an fla model's kernels on the same
rows (session 16: gla with fused_recurrent and chunk).
"""

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from flame.models import attention, load_model_config
from flame.models.inputs import document_kwargs, is_fla_config
from scripts.bench.packed_data import packed_batches

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def module_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """Gradient norm per module: a decoder block's children (``model.layers.3.attn``), other parameters by name."""
    squares = defaultdict(float)
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        parts = name.split(".")
        # "model.layers.3.attn.q_proj.weight" -> "model.layers.3.attn"
        key = ".".join(parts[:4]) if len(parts) > 4 and parts[1] == "layers" else name
        squares[key] += parameter.grad.float().pow(2).sum().item()
    return {key: value**0.5 for key, value in squares.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/gla_340M.json")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of the packed row")
    parser.add_argument("--batches", type=int, default=2, help="different rows to try")
    parser.add_argument("--repeats", type=int, default=3, help="forward + backward passes per row")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter and compute dtype")
    parser.add_argument("--autocast", action="store_true",
                        help="fp32 weights, forward under bf16 autocast: flame on one GPU (default: weights in --dtype, as FSDP casts them)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script with an HF config")
    parser.add_argument("--attn-mode", help="an fla config's attn_mode for this run (e.g. fused_recurrent against chunk)")
    args = parser.parse_args()

    config = load_model_config(args.config)
    if args.attn_mode:
        config.attn_mode = args.attn_mode
    options = {} if is_fla_config(config) else {"attn_implementation": attention.HF_ATTENTION}
    torch.manual_seed(0)
    dtype = torch.float32 if args.autocast else DTYPES[args.dtype]
    model = AutoModelForCausalLM.from_config(config, **options).to(args.device, dtype)
    for index, (ids, labels, cu_seqlens, max_seqlen) in enumerate(packed_batches(args.tokens, args.batches, device=args.device)):
        positions = torch.cat([torch.arange(n, device=args.device) for n in cu_seqlens.diff().tolist()])[None]
        # the documents as flame's trainer gives them to this model
        kwargs = document_kwargs(model, {"position_ids": positions, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen})
        for repeat in range(args.repeats):
            model.zero_grad(set_to_none=True)
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.autocast):
                logits = model(ids, **kwargs).logits  # kwargs hold use_cache=False
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            norms = module_grad_norms(model)
            largest = dict(sorted(norms.items(), key=lambda item: -item[1])[:5])
            total = sum(value**2 for value in norms.values()) ** 0.5
            print(json.dumps({"batch": index, "repeat": repeat, "documents": len(cu_seqlens) - 1, "loss": loss.item(),
                              "grad_norm": total, "largest": largest}), flush=True)


if __name__ == "__main__":
    main()
