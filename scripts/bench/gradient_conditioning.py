"""How sensitive is a model's gradient to tiny weight changes? CPU, fp64, no GPU kernels.

    python scripts/bench/gradient_conditioning.py gla transformer

Why: 340M gla layouts that agree at step 1 (the same loss, the same weights) part from step 2
or 3 on GPUs, in bf16 and in fp32, while the transformer's stay within 5e-5 (docs/perf-log.md,
sessions 13-16). Here each tiny config under configs/tiny runs in fp64 with fla's Triton
kernels replaced by PyTorch (tests/scripts/tp_grad_parity.py; gla's recurrence token by
token), on one packed row of 40 short random documents. Printed per model: the gradient norm at
the initial weights and after 4 draws of 1e-3 relative noise on every weight (the size of
TF32's or bf16's rounding), and where in gla's first layer dL/dq sits: the first token of
each document against all the others.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "scripts"))
import tp_grad_parity  # the PyTorch stand-ins for fla's Triton kernels

from flame.models import load_model_config, model_inputs

DOCUMENTS = 40


def packed_row(vocab_size: int) -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 60, (DOCUMENTS,), generator=generator).tolist()
    tokens = sum(lengths)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=generator)
    labels = torch.randint(0, vocab_size, (1, tokens), generator=generator)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input": ids, "position_ids": positions, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)}, labels


def main() -> None:
    torch.set_default_dtype(torch.float64)
    queries = []  # gla's q of each layer, kept for its gradient
    recurrence = tp_grad_parity.gla_recurrence

    def keep_queries(q, k, v, **kwargs):
        q.retain_grad()
        queries.append(q)
        return recurrence(q, k, v, **kwargs)

    for name in sys.argv[1:] or ["gla", "transformer"]:
        config = load_model_config(f"configs/tiny/{name}.json")
        torch.manual_seed(0)
        model = tp_grad_parity.build(config, fused=False).double()
        if name == "gla":
            from fla.layers import gla

            gla.chunk_gla = gla.fused_recurrent_gla = keep_queries
        batch, labels = packed_row(config.vocab_size)
        initial = {key: value.clone() for key, value in model.named_parameters()}
        norms, where = [], None
        for draw in range(5):
            with torch.no_grad():
                for key, parameter in model.named_parameters():
                    noise = 1e-3 * torch.randn_like(parameter) if draw else 0
                    parameter.copy_(initial[key] * (1 + noise))
            model.zero_grad(set_to_none=True)
            queries.clear()
            inputs, targets, kwargs = model_inputs(model, batch, labels)
            F.cross_entropy(model(inputs, **kwargs).logits.flatten(0, 1), targets.flatten()).backward()
            norms.append(sum(p.grad.pow(2).sum() for p in model.parameters()).sqrt().item())
            if draw == 0 and queries:
                first = torch.zeros(batch["input"].shape[1], dtype=torch.bool)
                first[batch["cu_seqlens"][:-1].long()] = True
                per_token = queries[0].grad[0].pow(2).sum((1, 2)).sqrt()
                where = (f"  layer 0 |dL/dq| at init: {per_token[first].norm():.4f} on the {DOCUMENTS} first tokens, "
                         f"{per_token[~first].norm():.4f} on the other {int((~first).sum())}")
        spread = (max(norms) - min(norms)) / norms[0]
        print(f"{name}: gradient norm {norms[0]:.4f} at init, {' '.join(f'{n:.4f}' for n in norms[1:])} "
              f"after 1e-3 noise (spread {spread:.1%})")
        if where:
            print(where)


if __name__ == "__main__":
    main()
