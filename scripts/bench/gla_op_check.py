"""Are fla's gla kernels' outputs and gradients right on packed documents? One GPU, no model.

    python scripts/bench/gla_op_check.py [--dtypes float32 bfloat16] [--modes fused_recurrent chunk]

Random q/k/v and gla-like gates (logsigmoid / 16) for 4 heads of 128 / 256 channels, on one row
of 12 packed documents of 1-700 tokens, through fla's chunk_gla / fused_recurrent_gla with
cu_seqlens, against the same recurrence in fp64 written token by token
(tests/scripts/tp_grad_parity.py). One JSON line per kernel and dtype: the relative error of the
output and of dq, dk, dv, dg, and the largest difference when the heads run as two calls of 2,
as under TP 2 (must be 0). Session 16 (H200): fused_recurrent 1.2e-6 in fp32, 3.7e-3 in bf16;
session 17 (H100, a scratch form of this check on the 8192-token GPU batch of
tests/scripts/tp_grad_parity.py): fused_recurrent's 4 heads against 2 + 2 bit-identical in fp32.
chunk autotunes for every new shape and dtype first (minutes on a fresh machine).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "scripts"))
from tp_grad_parity import gla_recurrence  # the fp64 reference

from flame.models import registry

HEADS, KEY, VALUE = 4, 128, 256
LENGTHS = [37, 512, 5, 300, 1, 128, 64, 700, 3, 256, 17, 33]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", choices=["fused_recurrent", "chunk"], default=["fused_recurrent", "chunk"])
    args = parser.parse_args()
    registry.import_fla()  # with flame's autotune fixes, as in training
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    kernels = {
        "fused_recurrent": lambda q, k, v, g, cu: fused_recurrent_gla(q, k, v, gk=g, cu_seqlens=cu)[0],
        "chunk": lambda q, k, v, g, cu: chunk_gla(q, k, v, g, cu_seqlens=cu)[0],
    }
    torch.manual_seed(0)
    tokens = sum(LENGTHS)
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).cuda()
    shape = (1, tokens, HEADS)
    inputs = [torch.randn(*shape, KEY, dtype=torch.float64, device="cuda") * 0.6 for _ in range(2)]
    inputs.append(torch.randn(*shape, VALUE, dtype=torch.float64, device="cuda") * 0.6)
    inputs.append(F.logsigmoid(torch.randn(*shape, KEY, dtype=torch.float64, device="cuda")) / 16)
    output_grad = torch.randn(*shape, VALUE, dtype=torch.float64, device="cuda")

    def run(kernel, dtype, head_groups=1):
        """Output and gradients; with head_groups > 1 the heads run in that many separate calls, as TP splits them."""
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        groups = zip(*(leaf.chunk(head_groups, dim=2) for leaf in leaves))
        output = torch.cat([kernel(*group, cu_seqlens) for group in groups], dim=2)
        grads = torch.autograd.grad(output, leaves, output_grad.to(dtype))
        return [output.double(), *(g.double() for g in grads)]

    reference = run(lambda q, k, v, g, cu: gla_recurrence(q, k, v, gk=g, cu_seqlens=cu)[0], torch.float64)
    for dtype in args.dtypes:
        for mode in args.modes:
            start = time.perf_counter()
            result = run(kernels[mode], getattr(torch, dtype))
            row = {"mode": mode, "dtype": dtype, "seconds": round(time.perf_counter() - start, 1)}
            for name, got, want in zip(["o", "dq", "dk", "dv", "dg"], result, reference):
                row[name] = ((got - want).norm() / want.norm()).item()
            # heads are independent, so two calls of 2 heads must repeat one call of 4 bit for bit (0.0)
            split = run(kernels[mode], getattr(torch, dtype), head_groups=2)
            row["heads_split_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(split, result))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
