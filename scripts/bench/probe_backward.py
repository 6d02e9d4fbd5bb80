"""The memory plan's GPU probe against one decoder block as it runs, at rows past the probe's longest.

    python scripts/bench/probe_backward.py transformer_7B gated_deltanet_1B --tokens 4096 16384 32768

The probe (flame.memory.probe) measures a model's activations at rows of 1K-4K tokens and the plan
extrapolates them to the job's rows (32K and more). Per fla config (its first --blocks blocks, bf16
weights as FSDP gathers them, or float32 under autocast with --autocast), one line per row length:

- kept: what the last block's forward left allocated for its backward (its output left out),
  against the probe's per-block fit;
- backward: what that block's backward allocated beyond what was live when it started, asked for
  every gradient (as training does) and for its input's gradient alone (as the probe does), the
  block's weight gradients shown apart, against the probe's per-token fit of it.

The plan counts a block's weight gradients itself, so the probe's fit should land between the
all-gradients peak less those gradients and the all-gradients peak.
"""

import argparse
from contextlib import nullcontext

import torch

from flame.memory import probe
from flame.memory.activations import backward_peak
from flame.models import load_model_config
from flame.models.builder import reinitialize
from flame.models.inputs import is_fla_config
from flame.models.registry import decoder_layers, meta_model

GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", metavar="NAME", help="fla configs under configs/, without .json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="row lengths")
    parser.add_argument("--blocks", type=int, default=2, help="decoder blocks built (the last one is measured)")
    parser.add_argument("--autocast", action="store_true", help="float32 weights under bf16 autocast (no FSDP)")
    return parser.parse_args()


def measure(name: str, args: argparse.Namespace) -> None:
    config = load_model_config(f"configs/{name}.json")
    if not is_fla_config(config):
        raise SystemExit(f"probe_backward: {name} is not an fla config (HF models are measured on the meta device)")
    config.num_hidden_layers = args.blocks
    profile = probe.probe(config, torch.bfloat16, "cuda", probe.PROBE_LENGTHS, args.autocast)
    model = meta_model(config)
    if not args.autocast:
        model = model.to(torch.bfloat16)
    model.to_empty(device="cuda")
    reinitialize(model)
    model.train()
    block = decoder_layers(model)[-1]
    weights = list(block.parameters())
    weight_grads = sum(p.numel() * p.element_size() for p in weights)
    seen = {}

    def entered(module, args, kwargs):
        torch.cuda.synchronize()
        seen["before"] = torch.cuda.memory_allocated()
        seen["input"] = args[0] if args else kwargs["hidden_states"]

    def left(module, args, kwargs, output):
        torch.cuda.synchronize()
        seen["after"] = torch.cuda.memory_allocated()
        seen["output"] = output[0] if isinstance(output, (tuple, list)) else output

    block.register_forward_pre_hook(entered, with_kwargs=True)
    block.register_forward_hook(left, with_kwargs=True)
    print(f"{name} ({args.blocks} blocks, {'float32 under autocast' if args.autocast else 'bf16'}): the block's "
          f"weight gradients {weight_grads / GIB:.3f} GiB; {profile.method}", flush=True)
    for tokens in args.tokens:
        ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
        documents = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        with torch.autocast("cuda", torch.bfloat16) if args.autocast else nullcontext():
            model.model(input_ids=ids, use_cache=False, cu_seqlens=documents)
        kept = seen["after"] - seen["before"] - seen["output"].untyped_storage().nbytes()
        every = backward_peak(seen["output"], [seen["input"], *weights], retain_graph=True)
        alone = backward_peak(seen["output"], [seen["input"]])
        print(f"  {tokens:>6} tokens: kept {kept / GIB:.3f} GiB (probe {profile.blocks[-1].at(tokens, False) / GIB:.3f}); "
              f"backward, every gradient {every / GIB:.3f} ({(every - weight_grads) / GIB:.3f} without the weights'), "
              f"the input's alone {alone / GIB:.3f} (probe {profile.backward.at(tokens, False) / GIB:.3f})", flush=True)
        seen.clear()
        del ids
        torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    for name in args.configs:
        measure(name, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
