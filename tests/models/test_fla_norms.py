"""--model.compiled_fla_norms on CPU: the compiled function's computation against fla's reference, the swap, the
refusal (the compiled kernel against fla's on a GPU: tests/gpu/test_fla_norms_gpu.py)."""

import pytest
import torch
from fla.modules.norm.layernorm import rms_norm_ref

import flame
from flame.base.errors import ConfigError
from flame.models import load_model_config
from flame.models.builder import FlameModelArgs
from flame.models.kernels import fla_norms
from flame.models.registry import meta_model
from tests.conftest import ROOT, parse_job


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_function_computes_flas_norm_and_hands_back_the_sum(dtype, with_residual):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=generator).to(dtype).requires_grad_()
    residual = torch.randn(3, 7, 64, generator=generator).requires_grad_() if with_residual else None  # fp32 stream
    weight = (1 + 0.1 * torch.randn(64, generator=generator)).requires_grad_()
    normed, summed = fla_norms._add_and_norm(x, residual, weight, None, 1e-6, True, False, None)
    expected, expected_sum = rms_norm_ref(x, weight, None, residual, 1e-6, prenorm=True, upcast=True)
    assert normed.dtype == dtype and summed.dtype == (torch.float32 if with_residual else dtype)  # as fla's kernel
    torch.testing.assert_close(normed, expected.to(dtype))
    torch.testing.assert_close(summed.float(), expected_sum.float())
    grads = torch.autograd.grad((normed.float().square().sum() + summed.float().sum()),
                                [t for t in (x, residual, weight) if t is not None])
    expected_grads = torch.autograd.grad((expected.to(dtype).float().square().sum() + expected_sum.float().sum()),
                                         [t for t in (x, residual, weight) if t is not None])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_under_autocast_the_normed_sum_comes_in_autocast_s_dtype_and_the_sum_in_the_residual_s():
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=generator), torch.randn(5, 64, generator=generator)  # float32 stream
    weight = 1 + 0.1 * torch.randn(64, generator=generator)
    normed, summed = fla_norms._add_and_norm(x, residual, weight, None, 1e-6, True, False, torch.bfloat16)
    expected, expected_sum = fla_norms._add_and_norm(x, residual, weight, None, 1e-6, True, False, None)
    assert (normed.dtype, summed.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(normed, expected.to(torch.bfloat16)) and torch.equal(summed, expected_sum)


class _StandInNorm(torch.nn.Module):
    """fla's RMSNorm as its callers see it (the forward's signature and its outputs' dtypes), in PyTorch."""

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        summed = x if residual is None else x.float() + residual.float()
        normed = torch.nn.functional.rms_norm(summed.float(), (summed.shape[-1],)).to(x.dtype)
        return (normed, summed) if prenorm else normed


def test_fla_s_own_kernel_s_output_is_cast_once_under_autocast_only():
    norm = _StandInNorm()
    norm.__class__ = fla_norms._swapped_class(_StandInNorm, compiled=False)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)  # the float32 residual stream of one GPU's autocast
    plain, plain_sum = _StandInNorm.forward(norm, x, residual, True)
    assert norm(x, residual, True)[0].dtype == torch.float32  # no autocast: as it was
    with torch.autocast("cpu", torch.bfloat16):
        normed, summed = norm(x, residual, True)
        alone = norm(x)
    assert (normed.dtype, summed.dtype, alone.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert torch.equal(normed, plain.to(torch.bfloat16)) and torch.equal(summed, plain_sum)


def test_fla_rms_norms_are_swapped_and_keep_their_class_name_and_weights():
    flame.register()
    model = meta_model(load_model_config(str(ROOT / "configs" / "tiny" / "gla.json")))
    before = {name for name, module in model.named_modules() if type(module).__name__ == "RMSNorm"}
    line = fla_norms.swap_norms(model, compiled=True, in_compute_dtype=False)
    after = {name for name, module in model.named_modules() if type(module).__name__ == "RMSNorm"
             and type(module).forward is fla_norms._forward}
    assert before and after == before and f"{len(before)} of fla's RMSNorms" in line
    assert all(name.endswith("norm") for name in after)  # the gated output norms (another class) are not among them


@pytest.mark.parametrize("flag", ["compiled_fla_norms", "fla_norms_in_compute_dtype"])
def test_a_transformers_model_is_refused_in_one_line(monkeypatch, flag):
    job_config = parse_job(monkeypatch, 1, "--model.config", "configs/tiny/llama.json", f"--model.{flag}",
                           "--model.tokenizer_path", "builtin:python-stdlib-bpe", "--training.dataset",
                           "builtin:python-stdlib")
    refused = f"--model.{flag} changes fla's RMSNorms; llama is a transformers"
    with pytest.raises(ConfigError, match=refused):
        FlameModelArgs().update_from_config(job_config)
