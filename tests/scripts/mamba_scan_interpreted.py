"""flame's selective-scan Triton kernels, run on the CPU by Triton's interpreter, against the PyTorch reference.

    TRITON_INTERPRET=1 PYTHONPATH=<repository root> python tests/scripts/mamba_scan_interpreted.py

A fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined. Prints one JSON
line, which tests/models/test_mamba_scan.py checks: for each case, the largest difference between the
kernels' and the reference's output and gradients, each relative to the reference's largest value.
    packed   two rows of documents (cu_seqlens; a document starting on a chunk boundary, one
             spanning chunks), x/z and B/C as views of wider projections, as fla's layer makes them
    rows     no cu_seqlens: each row one sequence; a length and a width that are no multiple of the blocks
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch

from flame.models.kernels.selective_scan import reference_scan, triton_scan

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def inputs(rows: int, length: int, channels: int, states: int, views: bool) -> list[torch.Tensor]:
    if views:  # as fla's layer slices them: x, z from in_proj's output; dt, B, C from x_proj's
        x, z = torch.randn(rows, length, 2 * channels).chunk(2, dim=-1)
        _, B, C = torch.split(torch.randn(rows, length, 3 + 2 * states), [3, states, states], dim=-1)
    else:
        x, z, B, C = (torch.randn(rows, length, width) for width in (channels, channels, states, states))
    dt = torch.randn(rows, length, channels) - 2.0  # softplus: dt ~ 0.1, as fla's init gives
    A = -torch.exp(torch.randn(channels, states))
    D, dt_bias = torch.randn(channels), 0.5 * torch.randn(channels)
    return [v.detach().requires_grad_() for v in (x, dt, A, B, C, D, z, dt_bias)]


def differences(rows, length, channels, states, cu_seqlens, views, **blocks) -> dict[str, float]:
    torch.manual_seed(0)
    tensors = inputs(rows, length, channels, states, views)
    dout = torch.randn(rows, length, channels)
    got = triton_scan(*tensors, cu_seqlens=cu_seqlens, **blocks)
    got_grads = torch.autograd.grad(got, tensors, dout)
    want = reference_scan(*tensors, cu_seqlens=cu_seqlens)
    want_grads = torch.autograd.grad(want, tensors, dout)
    pairs = {"y": (got, want), **{f"d{name}": pair for name, pair in zip(NAMES, zip(got_grads, want_grads))}}
    return {name: ((a - b).abs().max() / b.abs().max()).item() for name, (a, b) in pairs.items()}


cu_seqlens = torch.tensor([0, 5, 16, 20, 29, 40], dtype=torch.int32)  # rows of 20: 16 starts chunk 2, 20 is row 2
report = {
    "packed": differences(2, 20, 12, 4, cu_seqlens, True, chunk=8, block_d=8, backward_block_d=4),
    "rows": differences(3, 13, 10, 3, None, False, chunk=4, block_d=8, backward_block_d=8),
}
print(json.dumps(report))
