"""Models on CPU: document-masked attention, the fused loss, FLOPs, fla's import (bad input: test_model_refusals.py)."""

import math
import shutil
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from flame.base import batch_context

from flame import compat
from flame.base.batch_context import BatchContext
from flame.models.loss import (
    LossHead,
    linear_cross_entropy_sum,
    use_fused_cross_entropy,
)
from flame.models import load_model_config, model_inputs, registry
from flame.models.builder import FlameModelArgs, build_model
from flame.models.kernels import attention
from flame.models.flops import causal_pairs, model_flops
from tests.conftest import (
    ROOT,
    SCRIPTS,
    TINY_DECODER,
    base_args,
    check,
    flame_env,
    losses,
    torchrun,
    two_at_a_time,
)
from tests.scripts.torch_kernels import use_torch_kernels

TINY = {**TINY_DECODER, "vocab_size": 256}


def per_document_attention(q, k, v, cu_seqlens, window=None):
    """The reference: SDPA on each document alone (with an explicit sliding-window mask)."""
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = end - start
        i = torch.arange(n)
        mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
        q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 3])
def test_document_attention_equals_attention_per_document(window):
    torch.manual_seed(0)
    q = torch.randn(20, 4, 8)
    k, v = torch.randn(20, 2, 8), torch.randn(20, 2, 8)  # grouped-query: 2 kv heads
    cu_seqlens = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    out = attention.document_attention(q, k, v, cu_seqlens, 12, window=window)
    torch.testing.assert_close(out, per_document_attention(q, k, v, cu_seqlens, window))
    # the same tokens as 2 rows of 10 (documents end at the row boundary): the dense path masks per row
    cu_seqlens = torch.tensor([0, 4, 10, 13, 20], dtype=torch.int32)
    out = attention.document_attention(q, k, v, cu_seqlens, 7, window=window, rows=2)
    torch.testing.assert_close(out, per_document_attention(q, k, v, cu_seqlens, window))


def test_flash_attn_entry_points_for_fla_layers():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 8) for _ in range(3))
    # fla's layers call flash_attn_func on [batch, len, heads, dim]: each row is one sequence
    out = attention.flash_attn_func(q, k, v, causal=True)
    rows = torch.arange(0, 13, 6, dtype=torch.int32)
    flat = [t.reshape(12, 4, 8) for t in (q, k, v)]
    torch.testing.assert_close(out.reshape(12, 4, 8), per_document_attention(*flat, rows))
    # ... and flash_attn_varlen_func on packed tokens; window_size (w - 1, 0) keeps w keys
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = attention.flash_attn_varlen_func(*flat, cu_seqlens, cu_seqlens, 12, 12, causal=True, window_size=(2, 0))
    torch.testing.assert_close(out, per_document_attention(*flat, cu_seqlens, window=3))
    with pytest.raises(ValueError, match="causal"):
        attention.flash_attn_func(q, k, v, causal=False)
    registry.import_fla()
    import fla.layers.attn

    assert fla.layers.attn.flash_attn_varlen_func is attention.flash_attn_varlen_func


def _build(model_type: str, **overrides) -> torch.nn.Module:
    args = FlameModelArgs(config_path=model_type)
    registry.ensure_model_type(model_type)
    args._config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    return build_model(args)


def _batch(lengths: list[int]) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (1, sum(lengths) + 1))
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = {"input": ids[:, :-1], "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths), "position_ids": positions}
    return batch, ids[:, 1:]


def _loss_and_grads(model, batch, labels):
    model.zero_grad()
    inputs, labels, kwargs = model_inputs(model, batch, labels)
    logits = model(inputs, **kwargs).logits
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return logits, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_packed_documents_give_the_logits_and_gradients_of_separate_documents(model_type):
    model = _build(model_type)
    assert model.config._attn_implementation == attention.HF_ATTENTION
    lengths = [5, 17, 1, 9]
    batch, labels = _batch(lengths)
    packed_logits, packed_grads = _loss_and_grads(model, batch, labels)

    separate_logits, separate_grads = [], None
    model.zero_grad()
    for start, end in zip(batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist()):
        logits = model(batch["input"][:, start:end], use_cache=False).logits  # one document, no packing
        F.cross_entropy(logits[0], labels[0, start:end], reduction="sum").backward()
        separate_logits.append(logits)
    separate_grads = {name: p.grad for name, p in model.named_parameters()}
    torch.testing.assert_close(packed_logits, torch.cat(separate_logits, 1), atol=2e-5, rtol=1e-4)
    for name, grad in separate_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_compiled_blocks_take_rows_of_any_number_of_documents_one_included():
    """flame compiles each block once for any number of documents. A row of one document (cu_seqlens of 2)
    specializes the block's graph, which raised ConstraintViolationError while the count was marked
    strictly dynamic (fla's kernels and flame's PyTorch conv alike). Dynamo's eager backend: the guards
    are what is tested, not inductor's code."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs/tiny/mamba2.json")))
    use_torch_kernels(model)
    layouts = [[20, 44], [5, 40, 19], [64]]
    eager = [_logits(model, lengths) for lengths in layouts]
    for block in model.backbone.layers:
        block.compile(backend="eager")
    for lengths, expected in zip(layouts, eager):
        torch.testing.assert_close(_logits(model, lengths), expected, msg=str(lengths))


def _logits(model, lengths: list[int]) -> torch.Tensor:
    inputs, _, kwargs = model_inputs(model, *_batch(lengths))
    return model(inputs, **kwargs).logits


def test_sliding_window_of_hf_configs_is_honoured():
    model = _build("mistral", sliding_window=4)
    batch, labels = _batch([12])
    logits, _ = _loss_and_grads(model, batch, labels)
    reference = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, reference(batch["input"]).logits, atol=2e-5, rtol=1e-4)


def test_chunked_cross_entropy_equals_logits_cross_entropy(monkeypatch):
    import flame.models.loss as loss

    monkeypatch.setattr(loss, "CHUNK_TOKENS", 7)  # several chunks, the last one partial
    torch.manual_seed(0)
    hidden = torch.randn(30, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    targets = torch.randint(0, 50, (30,))
    targets[[0, 9, 29]] = -100  # ignored targets
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="sum", ignore_index=-100)
    expected_grads = torch.autograd.grad(expected, (hidden, weight, bias))
    got = linear_cross_entropy_sum(hidden, weight, bias, targets)
    torch.testing.assert_close(got, expected)
    for a, b in zip(torch.autograd.grad(2.5 * got, (hidden, weight, bias)), expected_grads):
        torch.testing.assert_close(a, 2.5 * b)


def test_loss_head_keeps_parameters_ties_and_plain_logits():
    model = _build("llama", tie_word_embeddings=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch, labels = _batch([6, 10])
    inputs, labels, kwargs = model_inputs(model, batch, labels)
    logits = model(inputs, **kwargs).logits
    head = use_fused_cross_entropy(model)
    assert isinstance(head, LossHead) and model.get_output_embeddings() is head
    assert head.weight is model.get_input_embeddings().weight
    assert model.state_dict().keys() == state.keys()
    torch.testing.assert_close(model(inputs, **kwargs).logits, logits)  # outside a batch: logits as before
    with batch_context.computing(BatchContext(targets=labels)):
        loss = model(inputs, **kwargs).logits
    assert loss.ndim == 0
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    torch.testing.assert_close(model(inputs, **kwargs).logits, logits)  # the batch's targets end with it


def test_fused_cross_entropy_refuses_heads_that_post_process_logits():
    model = _build("gemma2", final_logit_softcapping=30.0, head_dim=16)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        use_fused_cross_entropy(model)


def test_fused_cross_entropy_run_matches_the_plain_run(tmp_path, tiny_model, corpus):
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    plain_result, result = two_at_a_time(
        partial(torchrun, base_args(tiny_model, corpus, plain, steps=4) + ["--training.fused_cross_entropy=off"]),
        partial(torchrun, base_args(tiny_model, corpus, fused, steps=4) + ["--training.fused_cross_entropy=on"]),
    )
    check(plain_result)
    output = check(result).stdout + result.stderr
    assert "causal softmax attention over each batch's real documents" in output  # the MFU label
    assert sorted(losses(fused)) == sorted(losses(plain)) == [1, 2, 3, 4]
    for step, loss in losses(plain).items():
        assert math.isclose(losses(fused)[step], loss, rel_tol=1e-5), step


def test_flops_of_a_llama_config_by_hand():
    model = _build("llama", vocab_size=4096)
    flops = model_flops(model)
    # per layer: q 64x64 + k, v 64x32 (2 kv heads of 16) + o 64x64 + MLP 3 x 64x128; untied head 4096x64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert flops.matmul_params == 2 * per_layer + 4096 * 64
    assert flops.dense_per_token == 6 * flops.matmul_params
    # attention: 12 x (4 heads x 16) per layer x causal pairs of each document
    assert flops.batch_flops([3, 5]) == 6 * flops.matmul_params * 8 + 12 * 2 * 64 * (6 + 15)
    assert flops.flops_per_token(4) == 6 * flops.matmul_params + 12 * 2 * 64 * 10 // 4
    # the embedding is not a matmul; a tied head is its one parameter, counted once
    tied = model_flops(_build("llama", vocab_size=4096, tie_word_embeddings=True))
    assert tied.matmul_params == flops.matmul_params


def test_flops_of_a_gla_config_by_hand():
    registry.ensure_model_type("gla")
    config = AutoConfig.for_model(
        "gla", hidden_size=256, num_hidden_layers=2, num_heads=2, expand_k=0.5, expand_v=1, vocab_size=4096,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    flops = model_flops(model)
    # attn: q, k 256->128; v, g, o 256->256; low-rank forget gate 256->16->128; MLP 3 x 256x768
    per_layer = 2 * 128 * 256 + 3 * 256 * 256 + 16 * 256 + 128 * 16 + 3 * 256 * 768
    assert flops.matmul_params == 2 * per_layer + 4096 * 256
    # no softmax attention; per layer 3 x heads x (4 dk dv + 64 (dk + dv)), dk 64, dv 128
    state = 3 * 2 * (4 * 64 * 128 + 64 * (64 + 128))
    assert flops.attention_widths == {}
    assert flops.batch_flops([100, 28]) == (6 * flops.matmul_params + 2 * state) * 128


def test_causal_pairs_with_a_window():
    assert causal_pairs(5, None) == 15
    assert causal_pairs(5, 2) == 1 + 2 + 2 + 2 + 2
    assert causal_pairs(3, 8) == 6


def test_fla_is_imported_for_its_model_types_and_unknown_ones_only(monkeypatch):
    imports = []
    monkeypatch.setattr(registry, "import_fla", lambda: imports.append(True))
    monkeypatch.delitem(sys.modules, "fla", raising=False)  # as in a fresh process
    for model_type, imported in [("llama", False), ("flame_example_lm", False), ("gla", True),
                                 ("mamba", True), ("no_such_model", True)]:
        imports.clear()
        registry.ensure_model_type(model_type)
        assert bool(imports) == imported, model_type
    # fla imported by something else (a custom architecture built from its layers): flame's changes apply
    monkeypatch.setitem(sys.modules, "fla", object())
    imports.clear()
    registry.ensure_model_type("llama")
    assert imports


def test_fla_model_types_are_the_types_fla_registers():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    registry.import_fla()
    registered = {name for name in CONFIG_MAPPING if CONFIG_MAPPING[name].__module__.startswith("fla.")}
    assert registry.fla_model_types() == registered
    assert {"gla", "mamba", "mamba2", "cyclic_flow_attention"} <= registered  # the last in fla/models/cyfa


def test_deltaformer_kernels_tune_once_not_per_document_length():
    # fla keys them on the chunk/document length (C, T): under varlen every new length tuned anew
    from triton.runtime.autotuner import Autotuner

    registry.import_fla()
    from fla.ops.deltaformer import parallel

    kernels = {name: kernel for name, kernel in vars(parallel).items() if isinstance(kernel, Autotuner)}
    assert len(kernels) == 4
    assert all(kernel.keys == ["D"] for kernel in kernels.values()), {n: k.keys for n, k in kernels.items()}


def test_log_linear_mamba2_gives_its_kernel_level_scales_in_the_queries_dtype(monkeypatch):
    # under bf16 autocast its float32 level scales met bf16 queries in one Triton tl.dot, which fails to compile
    registry.import_fla()
    from fla.layers import log_linear_mamba2 as layer

    assert layer.chunk_log_linear_attn.casts_level_scales  # installed at fla's import
    seen = {}

    def kernel(q, k, v, g, level_scales, **kwargs):  # stands in for the Triton kernel: records its inputs
        seen.update(q=q.dtype, level_scales=level_scales.dtype)
        return torch.zeros_like(v), None

    monkeypatch.setattr(layer, "chunk_log_linear_attn", compat.fla.casting_level_scales(kernel))
    batch, length, heads, head_dim, state, levels = 1, 64, 2, 8, 16, 4
    bf16 = {"dtype": torch.bfloat16}
    layer.hmamba_chunk_scan_combined(  # the autocast case: projections in bf16, the L and A weights in float32
        torch.randn(batch, length, heads, head_dim, **bf16), torch.randn(batch, length, heads, **bf16),
        -torch.rand(heads), torch.randn(batch, length, 1, state, **bf16), torch.randn(batch, length, 1, state, **bf16),
        torch.randn(batch, length, heads, levels, **bf16), torch.randn(heads, levels), chunk_size=64, dt_softplus=True,
    )
    assert seen == {"q": torch.bfloat16, "level_scales": torch.bfloat16}


def test_moba_attention_runs_outside_compiled_graphs():
    # compiled with its blocks, its gathers failed with a device-side index assert (H100, docs/models-verified.md)
    registry.import_fla()
    from fla.layers import moba
    from fla.ops.moba import parallel

    assert moba.parallel_moba.runs_eagerly and moba.parallel_moba is not parallel.parallel_moba
    q, k, v = (torch.randn(1, 96, 2, 16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 40, 96], dtype=torch.int32)
    options = {"max_seqlen": 56, "chunk_size": 16, "topk": 2}
    assert torch.equal(moba.parallel_moba(q, k, v, cu_seqlens, **options), parallel.parallel_moba(q, k, v, cu_seqlens, **options))


@pytest.mark.parametrize("attn_mode, warned", [("chunk", True), ("fused_recurrent", False)])
def test_gla_chunk_kernels_gradient_spikes_are_named_on_gpus(monkeypatch, caplog, attn_mode, warned):
    from flame.base import device

    monkeypatch.setattr(device, "CUDA", True)
    config = load_model_config(str(ROOT / "configs/tiny/gla.json"))
    config.attn_mode = attn_mode
    args = FlameModelArgs(config_path="configs/tiny/gla.json")
    args._config = config
    with torch.device("meta"):
        build_model(args)
    message = '"attn_mode": "fused_recurrent" in the model config makes them rarer and smaller'
    assert (message in caplog.text) == warned


def test_fla_is_imported_when_a_config_needs_it_not_at_startup(tmp_path):
    # a fresh process: this one imported fla already. "mamba" is also transformers' own type;
    # fla registers its Mamba over it on import, and in flame the name means fla's.
    shutil.copy(ROOT / "configs" / "tiny" / "mamba.json", tmp_path / "config.json")
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "fla_imported_on_demand.py"), str(tmp_path)],
                                  cwd=ROOT, env=flame_env(), capture_output=True, text=True))
    assert result.stdout.split("\n")[:4] == [
        "True False",  # HF has a mamba; importing the trainer did not import fla
        "False",  # nor did an HF model's config
        "fla.models.mamba.configuration_mamba",  # a model directory of fla's mamba
        "fla.models.gla.configuration_gla",
    ]


def test_fla_layers_imported_before_flame_get_flames_attention():
    # a package under custom_models/ built from fla's layers imports fla before flame.models is done;
    # importing flame changes nothing, the first model config flame loads applies its changes to fla
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "fla_layers_before_flame.py")], cwd=ROOT,
                                  env=flame_env(), capture_output=True, text=True))
    assert result.stdout.split() == ["False", "True"]
