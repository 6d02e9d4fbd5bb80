"""How sensitive is a model's gradient to tiny weight changes?

    python scripts/bench/gradient_conditioning.py [gla transformer]          CPU, fp64, tiny configs
    python scripts/bench/gradient_conditioning.py --cuda [gla transformer]   one GPU, fp32, 340M configs

Why: 340M gla layouts that agree at step 1 (the same loss, the same weights) give different
step-1 gradients on GPUs and part from step 2 on, in bf16 and in fp32, while the transformer's
stay within 5e-5 (docs/perf-log.md, sessions 13-17).

Per model: the gradient at the initial weights, again (a GPU's kernels must repeat it bit for
bit), and after relative noise on every weight: with --cuda 1e-7 and 1e-6 (fp32's rounding,
the size of the differences another layout's matmul shapes make), on CPU 1e-3 in fp64 (bf16's
rounding). Printed: the gradient norm and the three parameters whose gradient moved most (the
largest change over the largest entry). For layer 0's queries: dL/dq on the first token of
each document against all others, and the share of its change that sits on first tokens. For
gla, the token whose dL/dq moved most: its position in its document and, per head, the
recurrence's first output coefficient c = scale * q.k, the mean square of the output its gated
norm divides by, and |dL/do| in front of that norm, before and after the noise.

CPU: fla's Triton kernels replaced by PyTorch (tests/scripts/tp_grad_parity.py; gla's
recurrence token by token), one row of 1,024 tokens of random documents of 1-64 tokens. --cuda:
fla's own kernels (gla with "attn_mode": "fused_recurrent"), tp_grad_parity's GPU batch (2 rows
of 4,096 tokens, documents of 1-512).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "scripts"))
import tp_grad_parity

from flame.models import load_model_config, model_inputs

CPU_BATCH = {"rows": 1, "length": 1024, "longest": 64, "device": "cpu"}  # about 30 documents: the recurrence runs token by token


class Probe:
    """Layer 0's attention: q and k (and gla's gated-norm input o) with their gradients, per backward."""

    def __init__(self, attn: torch.nn.Module):
        self.kept: dict[str, torch.Tensor] = {}
        self.attn = attn
        attn.q_proj.register_forward_hook(lambda module, args, out: self._keep("q_proj", out))
        attn.k_proj.register_forward_hook(lambda module, args, out: self._keep("k_proj", out))
        if hasattr(attn, "g_norm_swish_gate"):
            attn.g_norm_swish_gate.register_forward_pre_hook(lambda module, args: self._keep("o", args[0]))

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        tensor.retain_grad()
        self.kept[name] = tensor

    def snapshot(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: (t.detach().flatten(0, 1).float(), t.grad.flatten(0, 1).float()) for name, t in self.kept.items()}


def gradients(model, batch, labels) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    inputs, targets, kwargs = model_inputs(model, batch, labels)
    F.cross_entropy(model(inputs, **kwargs).logits.flatten(0, 1).float(), targets.flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def report(tag: str, base: dict, moved: dict) -> None:
    norm = torch.stack([g.norm() for g in moved.values()]).norm().item()
    change = {name: ((moved[name] - g).abs().max() / g.abs().max()).item() for name, g in base.items()}
    worst = sorted(change.items(), key=lambda item: -item[1])[:3]
    print(f"  {tag}: gradient norm {norm:.4g}; moved most: " + " ".join(f"{n}={e:.1e}" for n, e in worst), flush=True)


def first_token_report(attn, batch, before: dict, after: dict) -> None:
    starts = batch["cu_seqlens"][:-1].long()
    first = torch.zeros(before["q_proj"][1].shape[0], dtype=torch.bool, device=starts.device)
    first[starts] = True
    per_token = before["q_proj"][1].norm(dim=-1)
    change = (after["q_proj"][1] - before["q_proj"][1]).norm(dim=-1)
    print(f"  layer 0 |dL/dq|: {per_token[first].norm():.4g} on the {len(starts)} first tokens, {per_token[~first].norm():.4g} "
          f"on the other {int((~first).sum())}; {(change[first].norm() / change.norm()).item():.4%} of its change on first tokens")
    if "o" not in before:
        return
    token = int(change.argmax())
    heads, key = attn.num_heads, attn.head_k_dim
    q, k = (before[name][0][token].view(heads, key) for name in ("q_proj", "k_proj"))
    c = (q * k).sum(-1) * key**-0.5
    o, grad_before, grad_after = (t[token].view(heads, -1) for t in (*before["o"], after["o"][1]))

    def per_head(values, spec=".2e"):
        return " ".join(f"{x:{spec}}" for x in values.tolist())

    print(f"  token {token} (position {token - int(starts[starts <= token].max())} of its document), per head: "
          f"c {per_head(c)}; mean square of o {per_head(o.pow(2).mean(-1))}; "
          f"|dL/do| {per_head(grad_before.norm(dim=-1), '.4g')} -> {per_head(grad_after.norm(dim=-1), '.4g')}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["gla", "transformer"], help="gla and/or transformer (default: both)")
    parser.add_argument("--cuda", action="store_true", help="one GPU, fp32, fla's kernels, the 340M configs")
    args = parser.parse_args()
    if unknown := set(args.models) - {"gla", "transformer"}:
        parser.error(f"unknown model {', '.join(sorted(unknown))}: choose gla and/or transformer")
    device = "cuda" if args.cuda else "cpu"
    if not args.cuda:
        torch.set_default_dtype(torch.float64)
    noise = (1e-7, 1e-6) if args.cuda else (1e-3,) * 4
    for name in args.models:
        config = load_model_config(f"configs/{name}_340M.json" if args.cuda else f"configs/tiny/{name}.json")
        if name == "gla":
            config.attn_mode = "fused_recurrent"  # accurate to 1.2e-6 in fp32 (gla_op_check.py); chunk is worse
        torch.manual_seed(0)
        model = tp_grad_parity.build(config, fused=False, torch_kernels=not args.cuda).to(device)
        batch, labels = tp_grad_parity.packed_batch(config.vocab_size, **({} if args.cuda else CPU_BATCH))
        probe = Probe(model.model.layers[0].attn)
        initial = {key: p.detach().clone() for key, p in model.named_parameters()}
        print(f"{name} ({sum(p.numel() for p in initial.values()) / 1e6:.0f}M parameters, {device}):", flush=True)
        base = gradients(model, batch, labels)
        before = probe.snapshot()
        report("at init", base, base)
        report("again", base, gradients(model, batch, labels))
        generator = torch.Generator(device=device).manual_seed(1)
        for draw, size in enumerate(noise):
            with torch.no_grad():
                for key, p in model.named_parameters():
                    p.copy_(initial[key] * (1 + size * torch.randn(p.shape, device=device, generator=generator)))
            report(f"weights x (1 + {size:g} noise)", base, gradients(model, batch, labels))
            if draw == 0:
                first_token_report(probe.attn, batch, before, probe.snapshot())


if __name__ == "__main__":
    main()
