"""flame's varlen forward/backward on CUDA: torch's FlashAttention path against the reference path
(flame.models.kernels.flash_attn_internals; tests/models/test_moba_attention.py holds the reference to exact
attention on CPU). Skipped where there is no CUDA device."""

import pytest
import torch

from flame.models.kernels import flash_attn_internals

from flame.models import registry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _relative_error(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("causal", [True, False])
def test_torch_flash_path_matches_the_reference(causal):
    # segments with more keys than queries, grouped-query heads; bf16 runs torch's kernels, fp32 the reference
    torch.manual_seed(0)
    cu_q = torch.tensor([0, 100, 700, 1000], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 900, 1500], dtype=torch.int32, device="cuda")
    q = torch.randn(1000, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1500, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = (cu_q, cu_k, 600, 600)
    out, lse, *_ = flash_attn_internals.varlen_forward(q, k, v, *args, softmax_scale=0.125, causal=causal)
    ref_out, ref_lse, *_ = flash_attn_internals.varlen_forward(
        q.float(), k.float(), v.float(), *args, softmax_scale=0.125, causal=causal
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == ref_lse.shape == (4, 1000)
    assert _relative_error(out, ref_out) < 0.02
    assert (lse - ref_lse).abs().max() < 0.02

    # the backward takes out and lse as given (MoBA passes merged ones): give both paths the same
    dout = torch.randn_like(q)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    flash_attn_internals.varlen_backward(dout, q, k, v, out, lse, *grads, *args, softmax_scale=0.125, causal=causal)
    ref_grads = [torch.empty_like(x, dtype=torch.float32) for x in (q, k, v)]
    flash_attn_internals.varlen_backward(
        dout.float(), q.float(), k.float(), v.float(), out.float(), lse, *ref_grads, *args, softmax_scale=0.125,
        causal=causal,
    )
    for name, got, expected in zip("qkv", grads, ref_grads):
        assert _relative_error(got, expected) < 0.03, name


def test_moba_in_bf16_matches_its_float32_reference():
    # fla's parallel_moba: bf16 goes through torch's kernels, fp32 through the reference. topk covers
    # every chunk, so rounding cannot change which chunks the gate picks.
    registry.import_fla()
    from fla.ops.moba import parallel_moba

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 1000, 1700, 3000], dtype=torch.int32, device="cuda")
    inputs = [torch.randn(1, 3000, 4, 64, device="cuda") for _ in range(3)]
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (x.to(dtype).requires_grad_() for x in inputs)
        out = parallel_moba(q, k, v, cu_seqlens, max_seqlen=1300, chunk_size=64, topk=100)
        results.append([out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))])
    for name, got, expected in zip(("output", "dq", "dk", "dv"), *results):
        assert _relative_error(got, expected) < 0.03, name
