"""Exports load anywhere: fla's models after ``flame.register()`` without flash-attn, fla's transformer as llama."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import flame
from flame.base.errors import ConfigError
from flame.models.kernels import attention
from tests.conftest import ROOT, SCRIPTS, TOKENIZER, check, flame_env

# fla's transformer with what llama expresses and the defaults do not show: grouped-query heads,
# q/k/v biases, another rotary base, an MLP width of its own
FLA_TRANSFORMER = {"model_type": "transformer", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
                   "num_kv_heads": 2, "qkv_bias": True, "rope_theta": 500.0, "intermediate_size": 96,
                   "norm_eps": 1e-5, "vocab_size": 4096, "tie_word_embeddings": False, "fuse_cross_entropy": False}


def convert(module: str, *args: str) -> int:
    import importlib

    return importlib.import_module(module).main(list(args))


@pytest.fixture(scope="module")
def fla_transformer(tmp_path_factory):
    """A tiny fla transformer with random weights (biases and norms too): its HF folder and a dump folder holding
    it as step 0 (as a run would)."""
    from flame.models import load_model_config

    root = tmp_path_factory.mktemp("fla_transformer")
    (root / "config.json").write_text(json.dumps(FLA_TRANSFORMER))
    flame.register()  # without it fla's transformer refuses to build (no flash-attn)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(str(root / "config.json")))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0 if parameter.ndim > 1 else 1.0, 0.2)
    model.save_pretrained(root / "hf")
    dump = root / "dump"
    assert convert("flame.utils.convert_hf_to_dcp", "--model", str(root / "hf"),
                   "--checkpoint", str(dump / "checkpoint" / "step-0")) == 0
    return root, model.state_dict()


def fla_transformer_reference(weights: dict, ids: torch.Tensor) -> torch.Tensor:
    """fla's TransformerForCausalLM forward in plain torch ops, from its own weight names (fla's Triton norms,
    rotary and SwiGLU need a GPU; tests/gpu/test_exports.py compares with fla itself)."""
    c = FLA_TRANSFORMER
    heads, kv_heads, eps = c["num_heads"], c["num_kv_heads"], c["norm_eps"]
    dim = c["hidden_size"] // heads
    length = ids.shape[1]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    angles = torch.outer(torch.arange(length).float(), 1.0 / c["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rotate(x):  # [B, L, H, D], the two halves of each head (GPT-NeoX style)
        first, second = x.chunk(2, -1)
        return x * cos + torch.cat([-second, first], -1) * sin

    h = weights["model.embeddings.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        x = rms(h, w["attn_norm.weight"])
        q, k, v = (F.linear(x, w[f"attn.{p}_proj.weight"], w[f"attn.{p}_proj.bias"]).unflatten(-1, (-1, dim))
                   for p in "qkv")
        q, k = rotate(q), rotate(k)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + F.linear(o.transpose(1, 2).flatten(2), w["attn.o_proj.weight"])
        x = rms(h, w["mlp_norm.weight"])
        h = h + F.linear(F.silu(F.linear(x, w["mlp.gate_proj.weight"])) * F.linear(x, w["mlp.up_proj.weight"]),
                         w["mlp.down_proj.weight"])
    return F.linear(rms(h, weights["model.norm.weight"]), weights["lm_head.weight"])


def test_export_as_llama_computes_the_fla_transformers_logits(fla_transformer):
    root, weights = fla_transformer
    out = root / "llama"
    assert convert("flame.utils.convert_dcp_to_hf", "--path", str(root / "dump"), "--step", "0", "--config",
                   str(root / "config.json"), "--tokenizer", TOKENIZER, "--export_as", "llama", "--out", str(out)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    model = LlamaForCausalLM.from_pretrained(out)  # plain transformers, as vLLM's or llama.cpp's converters read it
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fla_transformer_reference(weights, ids), rtol=1e-5, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "`transformer, exported as `llama``" in card and f"parameters | {model.num_parameters():,}" in card


def test_export_as_llama_refuses_what_llama_cannot_express(fla_transformer, tmp_path, capsys):
    from flame.checkpoint import llama_export

    root, _ = fla_transformer
    config = AutoModelForCausalLM.from_pretrained(root / "hf").config
    config.qk_norm = True
    with pytest.raises(ConfigError, match="sets qk_norm True, and llama has no norms of queries and keys"):
        llama_export.check(config)
    config.qk_norm, config.window_size = False, 512
    with pytest.raises(ConfigError, match="window_size 512, and llama has no sliding-window attention"):
        llama_export.check(config)
    gla = root / "gla.json"
    gla.write_text((ROOT / "configs" / "tiny" / "gla.json").read_text())
    capsys.readouterr()
    assert convert("flame.utils.convert_dcp_to_hf", "--path", str(root / "dump"), "--config", str(gla), "--tokenizer",
                   TOKENIZER, "--export_as", "llama", "--out", str(tmp_path / "out")) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "only fla's transformer exports as llama, not gla" in error
    assert not (tmp_path / "out").exists()


def test_an_llama_export_is_refused_at_preflight_for_another_model(tmp_path, tiny_model, corpus, capsys):
    from flame.launch import preflight

    status = preflight.main(["--world-size", "1", "--", f"--model.config={tiny_model}",
                          f"--model.tokenizer_path={TOKENIZER}", f"--training.dataset={corpus}",
                          f"--job.dump_folder={tmp_path / 'dump'}", "--checkpoint.export_as", "llama"])
    assert status == 2 and not (tmp_path / "dump").exists()
    assert "--checkpoint.export_as llama: only fla's transformer exports as llama, not llama" in capsys.readouterr().err


def test_exports_load_in_a_fresh_interpreter_after_flame_register(fla_transformer, tmp_path):
    """fla's transformer builds without flash-attn (on CPU it can only be built: its norms and rotary are
    Triton's); an HF llama and a custom_models export run forward and generate; torchtitan stays out."""
    from flame.data.tokenizer import load_tokenizer
    from flame.models import load_model_config

    root, _ = fla_transformer
    for name, config in (("llama", ROOT / "configs" / "tiny" / "llama.json"),
                         ("custom", ROOT / "custom_models" / "example_lm" / "config_tiny.json")):
        AutoModelForCausalLM.from_config(load_model_config(str(config))).save_pretrained(tmp_path / name)
        load_tokenizer(TOKENIZER).save_pretrained(tmp_path / name)
    result = check(subprocess.run(
        [sys.executable, str(SCRIPTS / "load_exports.py"), "--fla-refuses", str(root / "hf"), f"{root / 'hf'}:build",
         f"{tmp_path / 'llama'}:padded", f"{tmp_path / 'custom'}:run"], cwd=ROOT, env=flame_env(), capture_output=True,
        text=True))
    report = json.loads(result.stdout.splitlines()[-1])
    assert "Please install Flash Attention" in report["without_flame"]  # what users saw, flame's stand-ins not installed
    assert report[str(root / "hf")]["class"] == "TransformerForCausalLM"
    assert report[str(tmp_path / "llama")]["class"] == "LlamaForCausalLM"
    assert report[str(tmp_path / "custom")]["class"] == "ExampleLMForCausalLM"
    assert report["torchtitan"] is False


def _reference(q, k, v, window=None):
    """Causal attention of [B, Lq, H, D] queries, the last Lq of [B, Lk, Hkv, D] keys, by hand."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    length_q, length_k = q.shape[2], k.shape[2]
    positions_q = torch.arange(length_k - length_q, length_k)[:, None]
    positions_k = torch.arange(length_k)[None, :]
    allowed = (positions_k <= positions_q) & (positions_q - positions_k < (window or length_k))
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("window", [None, 5])
def test_fla_attention_stand_ins_take_queries_after_cached_keys(window):
    """Generation with a cache: fla's layers call flash-attn with fewer queries than keys, aligned to the end."""
    flash_window = (-1, -1) if window is None else (window - 1, 0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8, generator=generator), *torch.randn(2, 2, 11, 2, 8, generator=generator)
    got = attention.flash_attn_func(q, k, v, causal=True, window_size=flash_window)
    torch.testing.assert_close(got, _reference(q, k, v, window))
    # the same sequences unpadded: 3 and 1 new queries after 11 and 6 keys
    cu_q, cu_k = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([0, 11, 17], dtype=torch.int32)
    flat_q, flat_k, flat_v = torch.cat([q[0], q[1, -1:]]), torch.cat([k[0], k[1, :6]]), torch.cat([v[0], v[1, :6]])
    got = attention.flash_attn_varlen_func(flat_q, flat_k, flat_v, cu_q, cu_k, 3, 11, causal=True, window_size=flash_window)
    expected = torch.cat([_reference(q[:1], k[:1], v[:1], window)[0],
                          _reference(q[1:, -1:], k[1:, :6], v[1:, :6], window)[0]])
    torch.testing.assert_close(got, expected)
