"""In a fresh process, as a user would: load flame's HF exports with transformers after ``flame.register()``.

    python tests/scripts/load_exports.py [--device cpu] [--fla-refuses FLA_DIR] [--save FILE] DIR[:MODE] ...

--fla-refuses FLA_DIR: first, before flame is imported, ``import fla`` and load FLA_DIR (an fla
transformer export): it must fail as users saw without flash-attn ("Please install Flash
Attention"). Then ``flame.register()``, and each DIR loads with AutoModelForCausalLM. MODE:
- ``build`` (default): only load it (fla's Triton kernels need a GPU to run);
- ``run``: also a forward pass on fixed ids, and greedy generation with the KV cache, which must
  choose the tokens that full forward passes without a cache choose;
- ``padded``: ``run``, and a left-padded batch of two prompts generates what each prompt alone does.
Prints one JSON line: each DIR's model class, whether torchtitan was imported, and, with --save,
writes each DIR's logits and generated ids to FILE (torch.save) for the test to compare.
"""

import argparse
import json
import sys

import torch

parser = argparse.ArgumentParser()
parser.add_argument("exports", nargs="+")
parser.add_argument("--device", default="cpu")
parser.add_argument("--fla-refuses")
parser.add_argument("--save")
args = parser.parse_args()

from transformers import AutoModelForCausalLM  # noqa: E402

report = {}
if args.fla_refuses:
    import fla  # noqa: F401  what a user without flame does

    try:
        AutoModelForCausalLM.from_pretrained(args.fla_refuses)
        report["without_flame"] = "loaded"
    except ImportError as error:
        report["without_flame"] = str(error)

import flame  # noqa: E402

flame.register()
report["torchtitan"] = "torchtitan" in sys.modules


def greedy_without_cache(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    for _ in range(new):
        logits = model(ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


saved = {}
for entry in args.exports:
    path, _, mode = entry.partition(":")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    report[path] = {"class": type(model).__name__}
    if mode not in ("run", "padded"):
        continue
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator).to(args.device)
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert torch.equal(generated, greedy_without_cache(model, ids, 8)), (generated, path)
        if mode == "padded":  # row 0 is 24 tokens, row 1 its last 16, padded on the left
            short = ids[1:, 8:]
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
            batch = torch.cat([ids[:1], torch.cat([torch.full_like(ids[1:, :8], pad), short], 1)])
            mask = torch.ones_like(batch)
            mask[1, :8] = 0
            together = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
            alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=8, do_sample=False)
            assert torch.equal(together[0], generated[0]), (together, generated, path)
            assert torch.equal(together[1, 24:], alone[0, 16:]), (together, alone, path)
    saved[path] = {"logits": logits.cpu(), "generated": generated.cpu()}
    report[path]["generated"] = generated[0, 24:].tolist()
if args.save:
    torch.save(saved, args.save)
print(json.dumps(report))
