"""HF models' norms, gated MLPs and rotary embeddings through fused kernels (flame.models.kernels.fused), on CPU.

On CPU the norms run torch's rms_norm and the MLPs and rotary embeddings HF's own code (fla's
kernels are CUDA's); tests/gpu/test_fused_kernels.py compares the CUDA kernels with HF's code.
"""

import copy
import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flame.compat import guard
from flame.models import load_model_config, registry
from flame.models.builder import FlameModelArgs, build_model
from flame.models.kernels import fused
from tests.conftest import ROOT, TINY_DECODER, parse_job


def _flame_and_hf(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model flame builds from ``config`` (its weights initialized), and HF's own with the same weights."""
    args = FlameModelArgs(config_path=config.model_type)
    registry.ensure_model_type(config.model_type)
    args._config = config
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    return model, reference


def _logits_and_grads(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype):
    model = copy.deepcopy(model).to(dtype)
    logits = model(ids, position_ids=torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.float(), {name: p.grad.float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_fused_models_give_hfs_logits_and_gradients(model_type):
    config = load_model_config(str(ROOT / "configs" / "tiny" / f"{model_type}.json"))
    model, reference = _flame_and_hf(config)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(type(m).forward is fused._rms_norm_forward for m in norms)  # the final norm, q/k norms too
    assert all(type(layer.mlp).forward is fused._gated_mlp_forward for layer in model.model.layers)
    modeling = importlib.import_module(type(reference).__module__)
    assert hasattr(modeling.apply_rotary_pos_emb, "__wrapped__")  # fuse_rotary's, in place of HF's
    assert f"transformers.fused_rotary({model_type})" in guard.applied()

    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    for dtype, tolerance in ((torch.float32, {}), (torch.bfloat16, {"rtol": 0.05, "atol": 0.05})):
        logits, grads = _logits_and_grads(model, ids, dtype)
        expected_logits, expected_grads = _logits_and_grads(reference, ids, dtype)
        torch.testing.assert_close(logits, expected_logits, **tolerance)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, **tolerance, msg=name)


def test_fused_modules_keep_names_parameters_and_classes():
    config = load_model_config(str(ROOT / "configs" / "tiny" / "qwen3.json"))
    model, reference = _flame_and_hf(config)
    # what checkpoints, tensor-parallel plans and exports see: HF's names, HF's classes by name
    assert list(model.state_dict()) == list(registry.meta_model(config).state_dict())
    for (name, module), (_, hf_module) in zip(model.named_modules(), reference.named_modules()):
        assert type(module).__name__ == type(hf_module).__name__ and isinstance(module, type(hf_module)), name


def _tiny(model_type: str, **fields) -> AutoConfig:
    return AutoConfig.for_model(model_type, **TINY_DECODER, vocab_size=256, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, **fields)


@pytest.mark.parametrize(("model_type", "fields", "norms", "mlps", "rotary"), [
    ("gemma", {"head_dim": 16}, False, False, True),  # (1 + weight) norms, GELU-gated MLPs
    ("olmo2", {}, False, True, True),  # norms that return the input's dtype, not the promoted one
    ("cohere", {}, False, True, False),  # LayerNorms; interleaved rotary
])
def test_modules_that_compute_something_else_keep_their_code(model_type, fields, norms, mlps, rotary):
    config = _tiny(model_type, **fields)
    model, reference = _flame_and_hf(config)
    types = [type(m) for m in model.modules()]
    assert any(getattr(t, "forward", None) is fused._rms_norm_forward for t in types) == norms
    assert any(getattr(t, "forward", None) is fused._gated_mlp_forward for t in types) == mlps
    modeling = importlib.import_module(type(reference).__module__)
    assert hasattr(modeling.apply_rotary_pos_emb, "__wrapped__") == rotary
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    (logits, grads), (expected_logits, expected_grads) = (_logits_and_grads(m, ids, torch.float32)
                                                          for m in (model, reference))
    torch.testing.assert_close(logits, expected_logits)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_no_fused_kernels_keeps_hfs_code(monkeypatch):
    job_config = parse_job(monkeypatch, 1, "--model.config", "configs/tiny/llama.json", "--model.no-fused_kernels",
                           "--model.tokenizer_path", "builtin:python-stdlib-bpe", "--training.dataset",
                           "builtin:python-stdlib")
    args = FlameModelArgs()
    args.update_from_config(job_config)
    assert args.fused_kernels is False
    model = build_model(args)
    assert not any(hasattr(type(m), "fused_from") for m in model.modules())
