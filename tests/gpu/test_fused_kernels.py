"""flame's fused kernels for HF models (flame.models.kernels.fused) on CUDA against HF's own code: torch's
fused rms_norm and fla's swiglu and rotary kernels, for llama and qwen3 (whose q/k norms are
fused too), in fp32, in bf16 (FSDP's mixed precision) and under autocast (one GPU's). Skipped
where there is no CUDA device."""

import copy
import importlib
import inspect
from contextlib import nullcontext

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from flame.models.kernels import fused

from flame.models import load_model_config
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"


def _inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # two rows; the second holds two documents (positions restart), so every token has its own angles
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (2, 256), generator=generator)
    positions = torch.stack([torch.arange(256), torch.cat([torch.arange(100), torch.arange(156)])])
    return ids.to(DEVICE), positions.to(DEVICE)


def _run(model, ids, positions, mode: str, monkeypatch, modeling=None):
    """Logits and every gradient (fp32 copies) of one forward/backward in ``mode``; with ``modeling``,
    its apply_rotary_pos_emb is HF's own meanwhile."""
    model = copy.deepcopy(model)
    if mode == "bf16":
        model.to(torch.bfloat16)
    with monkeypatch.context() as patch:
        if modeling is not None:
            patch.setattr(modeling, "apply_rotary_pos_emb", inspect.unwrap(modeling.apply_rotary_pos_emb))
        with torch.autocast(DEVICE, dtype=torch.bfloat16) if mode == "autocast" else nullcontext():
            logits = model(ids, position_ids=positions).logits
        logits.float().logsumexp(-1).sum().backward()
    return logits.float(), {name: p.grad.float() for name, p in model.named_parameters()}


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def _errors(got, expected) -> tuple[float, float, dict[str, float]]:
    """Relative errors of the logits, of all gradients together, and of each parameter's gradient."""
    (logits, grads), (expected_logits, expected_grads) = got, expected
    flat = _error(torch.cat([grads[n].flatten() for n in expected_grads]),
                  torch.cat([g.flatten() for g in expected_grads.values()]))
    return _error(logits, expected_logits), flat, {n: _error(grads[n], g) for n, g in expected_grads.items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_fused_kernels_match_hfs_code(model_type, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 means fp32 on both sides
    config = load_model_config(str(ROOT / "configs" / "tiny" / f"{model_type}.json"))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE)
    model = copy.deepcopy(hf)
    changed = fused.use_fused_kernels(model)
    assert changed.norms and changed.mlps and changed.rotary, changed
    modeling = importlib.import_module(type(hf).__module__)
    ids, positions = _inputs(config.vocab_size)

    # the fused kernels run (none fell back to HF's code): torch's fused norm and fla's Triton kernels
    _run(model, ids, positions, "bf16", monkeypatch)  # fla's autotuning, outside the trace
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        _run(model, ids, positions, "bf16", monkeypatch)
        torch.cuda.synchronize()
    names = {event.key for event in trace.key_averages()}
    assert "aten::_fused_rms_norm" in names and "aten::_fused_rms_norm_backward" in names, sorted(names)
    for kernel in ("rotary_embedding_kernel", "swiglu_fwd_kernel", "swiglu_fwdbwd_kernel"):
        assert any(kernel in name for name in names), (kernel, sorted(names))

    reference = _run(hf, ids, positions, "fp32", monkeypatch, modeling)
    logits_error, grads_error, _ = _errors(_run(model, ids, positions, "fp32", monkeypatch), reference)
    assert logits_error < 1e-4 and grads_error < 1e-4, (logits_error, grads_error)
    # in bf16, the fused path is as close to the fp32 reference as HF's own code
    for mode in ("bf16", "autocast"):
        fused_errors = _errors(_run(model, ids, positions, mode, monkeypatch), reference)
        hf_errors = _errors(_run(hf, ids, positions, mode, monkeypatch, modeling), reference)
        assert fused_errors[0] <= 1.5 * hf_errors[0] + 1e-3, (mode, "logits", fused_errors[0], hf_errors[0])
        assert fused_errors[1] <= 1.5 * hf_errors[1] + 1e-3, (mode, "gradients", fused_errors[1], hf_errors[1])
        for name, error in fused_errors[2].items():
            assert error <= 3 * hf_errors[2][name] + 1e-2, (mode, name, error, hf_errors[2][name])
