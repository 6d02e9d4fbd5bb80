"""On a GPU: --model.compiled_fla_norms computes fla's RMSNorm (its residual add included), forward and backward,
in the precisions training runs it (flame.models.kernels.fla_norms), and is timed beside it; with
--model.fla_norms_in_compute_dtype, under autocast, either kernel's normed output comes in autocast's dtype, the
values fla's would be cast to."""

import pytest
import torch
from torch import nn

from flame.models.kernels import fla_norms
from flame.models.registry import import_fla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a GPU")


class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        import_fla()
        from fla.modules import RMSNorm

        self.norm = RMSNorm(1024, eps=1e-6)


def _pass(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, grad: torch.Tensor):
    normed, summed = norm(x, residual, True)
    torch.autograd.backward([normed, summed], [grad.to(normed.dtype), grad.to(summed.dtype)])
    return normed, summed


@pytest.mark.parametrize("stream", [torch.float32, torch.bfloat16])  # one GPU's autocast stream, FSDP's
def test_the_compiled_norm_computes_flas_and_is_timed(stream):
    torch.manual_seed(0)
    fla_own, compiled = _Norms().cuda(), _Norms().cuda()
    with torch.no_grad():
        fla_own.norm.weight.uniform_(0.5, 1.5)
        compiled.norm.weight.copy_(fla_own.norm.weight)
    assert "1 of fla's RMSNorms" in fla_norms.swap_norms(compiled, compiled=True, in_compute_dtype=False)
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(8192, 1024, device="cuda", dtype=stream)
    grad = torch.randn(8192, 1024, device="cuda")
    results = {}
    for name, module in (("fla", fla_own), ("compiled", compiled)):
        inputs = [t.clone().requires_grad_() for t in (x, residual)]
        normed, summed = _pass(module.norm, *inputs, grad)
        results[name] = (normed, summed, inputs[0].grad, inputs[1].grad, module.norm.weight.grad)
        module.norm.weight.grad = None
    for expected, got in zip(results["fla"], results["compiled"]):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)

    def milliseconds(module) -> float:
        inputs = [t.clone().requires_grad_() for t in (x, residual)]
        for _ in range(3):
            _pass(module.norm, *inputs, grad)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            _pass(module.norm, *inputs, grad)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    print(f"{stream} stream, 8192 x 1024: fla {milliseconds(fla_own):.3f} ms, compiled {milliseconds(compiled):.3f} ms")


@pytest.mark.parametrize("compiled", [True, False])
def test_under_autocast_the_normed_output_comes_in_autocast_s_dtype_when_asked(compiled):
    torch.manual_seed(0)
    fla_own, swapped, dtype_kept = _Norms().cuda(), _Norms().cuda(), _Norms().cuda()
    fla_norms.swap_norms(swapped, compiled=compiled, in_compute_dtype=True)
    fla_norms.swap_norms(dtype_kept, compiled=compiled, in_compute_dtype=False)
    x, residual = torch.randn(4096, 1024, device="cuda"), torch.randn(4096, 1024, device="cuda")  # one GPU's float32 stream
    with torch.autocast("cuda", torch.bfloat16):
        expected, expected_sum = fla_own.norm(x, residual, True)
        got, got_sum = swapped.norm(x, residual, True)
        kept, _ = dtype_kept.norm(x, residual, True)
        projected = nn.functional.linear(got, swapped.norm.weight.new_ones(8, 1024))  # reads it with no cast
    assert (expected.dtype, kept.dtype) == (torch.float32, torch.float32)  # fla's, and without the flag
    assert (got.dtype, got_sum.dtype, projected.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    torch.testing.assert_close(got, expected.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_sum, expected_sum)
