"""The memory plan (--memory.plan): what it measures, what it chooses as the budget shrinks, what it keeps."""

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
from transformers import LlamaConfig

from flame import memory
from flame.base.errors import ConfigError
from flame.memory import activations, hardware, probe
from flame.memory.estimate import (
    GIB,
    MARGINS,
    ONE_GPU,
    activation_bytes,
    activation_moments,
    backward_bytes,
    autocast_copies,
    estimate,
    gpu_bytes,
    host_bytes,
)
from flame.memory.hardware import Hardware
from flame.memory.layout import Layout
from flame.memory.plan import PRICE_TOLERANCE, candidates, choose, table
from flame.memory.price import price
from flame.models.kernels import attention
from flame.models import builder, load_model_config, lora, moe
from flame.models.registry import decoder_layers, meta_model, register_all
from flame.optim.adamw import ADAMW
from flame.optim.muon import MUON
from tests.conftest import (
    ROOT,
    TINY_DECODER,
    TOKENIZER,
    assert_same_curve,
    base_args,
    flame_env,
    losses,
    metrics,
    parse_job,
    torchrun,
    two_at_a_time,
)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny llama with room for 512-token rows, where activations and logits are both large enough to matter."""
    path = tmp_path_factory.mktemp("model") / "llama_512.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512,
                                "vocab_size": 4096, "tie_word_embeddings": False}))
    return str(path)


def job_args(model: str, *extra: str) -> list[str]:
    return [f"--model.config={model}", f"--model.tokenizer_path={TOKENIZER}", "--training.dataset=builtin:python-stdlib",
            "--training.seq_len=512", "--training.batch_size=8", *extra]


def tiny_llama(layers: int) -> LlamaConfig:
    register_all()
    return LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": layers}, vocab_size=4096, max_position_embeddings=512)


def test_saved_bytes_grow_linearly_with_tokens_once_the_attention_weights_are_taken_out():
    config = tiny_llama(2)
    profile = activations.measure(config, torch.float32)
    assert profile.method.startswith("measured")
    block = profile.blocks[1]
    # the only T² term is math SDPA's attention weights: one fp32 T x T matrix per head
    assert block.square == TINY_DECODER["num_attention_heads"] * 4
    # a length the fit never saw: what the forward saves is exactly linear + that T² term
    model = meta_model(config).float()
    save_list = activations.compat.torchtitan.op_sac_save_list()
    for tokens in (48, 256):
        saved = activations._saved_per_block(model, tokens, save_list)[0][1]
        assert saved == pytest.approx(block.at(tokens)), tokens
    assert block.linear > 10 * profile.block_input  # a block keeps far more than its input


def test_saved_bytes_grow_linearly_with_blocks():
    two, four = (activations.measure(tiny_llama(n), torch.float32) for n in (2, 4))
    assert len(four.blocks) == 4
    assert sum(b.linear for b in four.blocks) - sum(b.linear for b in two.blocks) == pytest.approx(2 * two.blocks[1].linear)
    assert four.blocks[3] == two.blocks[1]  # the blocks after the first are alike
    assert four.rest == two.rest


def saved_storages(module, *inputs) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each storage ``module``'s forward keeps for its backward, weights left out."""
    weights = {p.untyped_storage()._cdata for p in module.parameters()}
    kept = {}

    def pack(tensor):
        if tensor.untyped_storage()._cdata not in weights:
            kept.setdefault(tensor.untyped_storage()._cdata, (tensor.numel(), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sorted(kept.values(), key=lambda elements_dtype: (elements_dtype[0], str(elements_dtype[1])))


@pytest.mark.parametrize("grouped", [True, False], ids=["varlen_groups", "varlen_repeats"])
def test_an_hf_models_attention_is_measured_by_what_flames_flash_kernels_keep(grouped, monkeypatch):
    """A GPU job's HF model attends through flame's varlen or flex kernel. Both keep the flattened queries and keys
    (copied out of HF's layout), the values (a view of their projection) and a float32 logsumexp per head; varlen
    without grouped-query support (torch 2.11) keeps each key and value head repeated for its query heads instead.
    The meta forward's math attention would keep float32 copies of the queries, the transposed keys and the
    values, every head repeated, and the T x T weights. The output is the o_proj's input, counted either way."""
    monkeypatch.setattr(attention, "_VARLEN_HAS_GQA", grouped)
    monkeypatch.setattr(activations, "_PROFILES", {})
    config = tiny_llama(2)  # 4 query heads, 2 key/value heads, 16 wide
    heads, kv_heads, head_dim, bf16, fp32 = 4, 2, 16, 2, 4
    math = activations.measure(config, torch.bfloat16, attention="sdpa")
    assert math.blocks[1].square > 0 and "attention's" not in math.method
    for backend in ("varlen", "flex"):
        flash = activations.measure(config, torch.bfloat16, attention=backend)
        assert f"{backend} attention's" in flash.method and flash.blocks[1].square == 0
        keys_values = 2 * (heads if backend == "varlen" and not grouped else kv_heads) * head_dim * bf16
        kept = heads * head_dim * bf16 + keys_values + heads * fp32
        assert math.blocks[1].linear - flash.blocks[1].linear == 3 * heads * head_dim * fp32 - kept


def test_a_gpu_job_s_fused_norms_and_mlps_are_measured_by_what_their_kernels_keep():
    """On a GPU, flame runs HF's norms and SiLU MLPs on fused kernels (flame.models.kernels.fused), which keep less
    than HF's code: the norm its input and one fp32 statistic per row, the MLP its gate and up projections."""
    from flame.models.kernels.fused import kept_as_on_cuda, use_fused_kernels

    config = tiny_llama(2)
    model = meta_model(config).to(torch.bfloat16)
    fused = use_fused_kernels(model)
    assert fused.norms and fused.mlps
    block, hidden, inner = decoder_layers(model)[0], config.hidden_size, config.intermediate_size
    x = torch.empty(1, 8, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with kept_as_on_cuda():
        assert saved_storages(block.input_layernorm, x) == [(8, torch.float32), (8 * hidden, torch.bfloat16)]
        assert saved_storages(block.mlp, x) == [(8 * hidden, torch.bfloat16)] + [(8 * inner, torch.bfloat16)] * 2
    assert len(saved_storages(block.mlp, x)) > 3  # HF's code keeps the SiLU and its product too
    hf, kernels = (activations.measure(config, torch.bfloat16, fused=on) for on in (False, True))
    assert kernels.blocks[1].linear < hf.blocks[1].linear - 2 * inner * 2  # two intermediate-sized tensors less at least
    assert "flame's fused norms and MLPs" in kernels.method


def test_a_lora_jobs_activations_are_measured_with_its_adapters_on_the_fused_mlp():
    """Under LoRA the frozen base keeps no inputs for weight gradients, and an adapted down projection is no longer
    the plain Linear the fused SwiGLU+Linear kernel reads: the fused MLP then hands the SiLU product to the adapter,
    which keeps it (an intermediate-sized tensor a token the base job's kernel recomputes). Measured without the
    adapters, the plan priced a 26B LoRA job's kept blocks short by that tensor and ran out of memory."""
    config, inner = tiny_llama(2), TINY_DECODER["intermediate_size"]
    base = activations.measure(config, torch.bfloat16, fused=True)

    def with_lora(targets: str) -> activations.ActivationProfile:
        adapters = lora.LoraSettings(rank=4, alpha=8, dropout=0.0, targets=tuple(targets.split(",")))
        return activations.measure(config, torch.bfloat16, fused=True, adapters=adapters)

    every, attention_only = with_lora("all-linear"), with_lora("q_proj,v_proj")
    rank_terms = 7 * 4 * 2 * 2  # each adapter's rank-wide output, a generous bound
    # all seven layers adapted: the down projection's input kept as well, the rest shared with the base's
    assert every.blocks[1].linear - base.blocks[1].linear == pytest.approx(inner * 2, abs=rank_terms)
    # q and v only: nothing keeps the MLP's input any more (its projections are frozen), nor o_proj's
    assert attention_only.blocks[1].linear < base.blocks[1].linear - TINY_DECODER["hidden_size"] * 2


def test_a_compiled_hf_job_is_measured_with_the_fused_kernels_that_stand_in_for_inductor(long_model, monkeypatch):
    """Compiled blocks run HF's code, whose elementwise ops inductor fuses: on a GPU the plan measures them with
    flame's fused norms and MLPs (what they keep is close to what the compiled block keeps), even where the
    eager job would run HF's own code (--model.no-fused_kernels)."""
    monkeypatch.setattr(memory.device, "CUDA", True)
    measured = []
    monkeypatch.setattr(activations, "measure", lambda config, dtype, fused, autocast, attention, adapters: measured.append(fused))

    def fused(*flags) -> bool:
        measured.clear()
        memory.job_of(parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off", *flags)), 1)
        return measured[0]

    assert fused() and fused("--training.compile") and fused("--training.compile", "--model.no-fused_kernels")
    assert not fused("--model.no-fused_kernels")


def test_a_meta_forward_that_reaches_a_triton_kernel_stops_there_and_the_plan_takes_the_formula(monkeypatch):
    """On a GPU a kernel launched on meta tensors reads null pointers and poisons the process's CUDA context.

    The block that stopped leaves no dispatch mode behind: one left on the stack ran every later
    op of the training through Python (mamba2 340M at two thirds of its speed)."""
    import triton
    import triton.language as tl
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from triton.runtime.jit import KernelInterface

    @triton.jit
    def copy_kernel(x, y):
        tl.store(y, tl.load(x))

    launch = KernelInterface.__getitem__
    meta = torch.empty(1, device="meta")
    refused = pytest.raises(activations.compat.triton.KernelLaunchRefused, match="Triton kernel copy_kernel")
    with refused, activations.compat.triton.kernel_launches_refused():
        copy_kernel[(1,)](meta, meta)
    assert KernelInterface.__getitem__ is launch  # launches work again after the block

    monkeypatch.setattr(activations, "_PROFILES", {})  # measured here, not taken from an earlier test's cache
    profile = activations.measure(load_model_config(str(ROOT / "configs/tiny/gla.json")), torch.bfloat16)
    assert "the meta forward reached Triton kernel layer_norm_fwd_kernel" in profile.method  # fla's fused norm
    assert KernelInterface.__getitem__ is launch
    assert _get_current_dispatch_mode() is None


def probe_on_the_cpu(monkeypatch, cache) -> None:
    """The meta forward refused as a Triton kernel refuses it, and the GPU probe run on the CPU instead (HF's
    eager attention keeps there what it keeps on meta), at the meta forward's lengths (the same fit)."""
    @contextlib.contextmanager
    def refused():
        raise activations.compat.triton.KernelLaunchRefused("Triton kernel chunk_fwd (the test)")
        yield

    monkeypatch.setattr(activations.compat.triton, "kernel_launches_refused", refused)
    monkeypatch.setattr(probe, "probe_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(probe, "PROBE_LENGTHS", activations.LENGTHS)
    monkeypatch.setenv("FLAME_CACHE", str(cache))
    monkeypatch.setattr(activations, "_PROFILES", {})


def test_a_model_the_meta_forward_cannot_run_is_measured_on_its_device_once_per_machine(tmp_path, monkeypatch):
    """fla's Triton kernels cannot run on meta tensors: the plan measures such a model on the GPU, with the
    meta forward's hooks, and caches it. Here the probe runs on the CPU (HF's eager attention keeps the same
    tensors there as on meta) and the meta forward is refused as a Triton kernel refuses it."""
    config = tiny_llama(2)
    config._attn_implementation = "eager"
    monkeypatch.setattr(activations, "_PROFILES", {})
    on_meta = activations.measure(config, torch.float32)
    assert on_meta.method.startswith("measured (meta-device forward")

    probe_on_the_cpu(monkeypatch, tmp_path)
    probed = activations.measure(config, torch.float32)
    assert probed.method == "measured (on the cpu, float32 weights: forward at 32, 64, 128 tokens, saved tensors)"
    assert probed.triton_kernels and not on_meta.triton_kernels  # the plan leaves room for such kernels' tuning
    assert dataclasses.replace(probed, method="", triton_kernels=False) == dataclasses.replace(on_meta, method="")
    cached, = (tmp_path / "activations").glob("*.json")

    probes = []

    def measured_again(*args):
        probes.append(args)
        raise AssertionError("measured again: the cached probe was not read")

    monkeypatch.setattr(probe, "probe", measured_again)
    monkeypatch.setattr(activations, "_PROFILES", {})  # a new process: the ranks read what the check measured
    assert activations.measure(config, torch.float32) == probed
    cached.write_text("{}")  # from an older flame: measured again, and a failing probe leaves the formula
    monkeypatch.setattr(activations, "_PROFILES", {})
    fallback = activations.measure(config, torch.float32)
    assert fallback.method.startswith("formula (17 x hidden per token per block; the meta forward reached Triton "
                                      "kernel chunk_fwd (the test); the GPU probe failed: AssertionError: measured again")
    monkeypatch.setattr(activations, "_PROFILES", {})  # cached too: every rank plans alike, none probes again
    assert activations.measure(config, torch.float32) == fallback and len(probes) == 1


def test_a_model_too_large_to_probe_whole_is_measured_on_its_first_blocks_repeated(tmp_path, monkeypatch):
    """A 7B under autocast does not fit an 80 GB GPU whole (float32 weights, their copies, 4K tokens'
    activations): out of memory, the probe measures the first three blocks and repeats the later two, which
    for a stack of alike blocks is what the whole model's probe gives (the first keeps the embeddings' output)."""
    config = tiny_llama(5)
    config._attn_implementation = "eager"
    probe_on_the_cpu(monkeypatch, tmp_path / "whole")
    whole = activations.measure(config, torch.float32)
    whole_probe, shapes = probe.probe, []

    def out_of_memory_beyond_two_blocks(model_config, *args, **kwargs):
        shapes.append(model_config.num_hidden_layers)
        if model_config.num_hidden_layers > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (the test)")
        return whole_probe(model_config, *args, **kwargs)

    monkeypatch.setattr(probe, "probe", out_of_memory_beyond_two_blocks)
    probe_on_the_cpu(monkeypatch, tmp_path / "first_blocks")
    first = activations.measure(config, torch.float32)
    assert shapes == [5, 3] and config.num_hidden_layers == 5  # the job's config is left whole
    assert first.method.endswith("; the first 3 of 5 blocks, the later ones repeated: the whole model did not fit "
                                 "the GPU)")
    assert len(first.blocks) == 5 and first.blocks[0] != first.blocks[1]
    assert dataclasses.replace(first, method="") == dataclasses.replace(whole, method="")


def test_a_model_whose_weights_and_activations_would_fill_the_gpu_is_probed_on_its_first_blocks_at_once(tmp_path,
                                                                                                       monkeypatch):
    """Out of memory, a probe's tensors stay held in its process for a while (a 7B under autocast on an H100:
    every probe after it ran out of memory too); a model that would take more than WHOLE_SHARE of the free
    memory (weights, and the formula's activations at the longest row) is measured on its first blocks at once."""
    config = tiny_llama(5)
    config._attn_implementation = "eager"
    shapes = []
    whole_probe = probe.probe

    def recorded(model_config, *args, **kwargs):
        shapes.append(model_config.num_hidden_layers)
        return whole_probe(model_config, *args, **kwargs)

    probe_on_the_cpu(monkeypatch, tmp_path / "roomy")
    monkeypatch.setattr(probe, "probe", recorded)
    activations.measure(config, torch.float32)
    params = sum(p.numel() for p in meta_model(config).parameters())
    saved = 5 * max(probe.PROBE_LENGTHS) * activations.FALLBACK_TENSORS_PER_HIDDEN * config.hidden_size * 4
    probe_on_the_cpu(monkeypatch, tmp_path / "tight")
    monkeypatch.setattr(probe, "_free_bytes", lambda where: (4 * params + saved) / probe.WHOLE_SHARE - 1)
    first = activations.measure(config, torch.float32)
    assert shapes == [5, 3] and "the first 3 of 5 blocks" in first.method
    # under autocast the weights count 6 bytes (float32 and a 16-bit copy): the same room no longer holds them
    monkeypatch.setattr(probe, "_free_bytes", lambda where: (4 * params + saved) / probe.WHOLE_SHARE)
    assert probe._fits_whole(config, torch.bfloat16, torch.device("cpu"), autocast=False)
    assert not probe._fits_whole(config, torch.bfloat16, torch.device("cpu"), autocast=True)


def test_a_blocks_backward_buffers_grow_by_their_slope_between_the_two_longest_rows():
    """What a 7B block's backward allocated at the probe's 1K/2K/4K rows when its weights' gradients (0.4 GB)
    set the short rows' peaks: a fit through all three points would slope down (negative bytes at 32K tokens);
    the growth between the two longest rows is what grows with the row."""
    rows = (1024, 2048, 4096)
    peaks = [0.40 * GIB, 0.40 * GIB, 0.45 * GIB]
    assert activations._fit(peaks, rows).at(32768, with_square=False) < 0
    slope = activations._slope(peaks, rows)
    assert slope.square == 0 and slope.at(32768) == pytest.approx(0.05 * GIB / 2048 * 32768)
    assert activations._slope([0.5 * GIB, 0.4 * GIB, 0.3 * GIB], rows).at(32768) == 0  # never below nothing


def test_a_probe_leaves_nothing_alive_whether_it_finishes_or_runs_out_of_memory(monkeypatch):
    """The hooks that count saved tensors must not tie the forward's graph into a cycle through autograd's C++
    (which Python's collector cannot see): the probe's model, weights and activations would stay held for
    the rest of the process (a 7B's first probe kept 70.8 GiB on an H100, and every probe after it failed)."""
    config = tiny_llama(3)
    config._attn_implementation = "eager"
    built, initialize = [], builder.reinitialize

    def recorded(model):  # the model as materialized on the probe's device
        built.append([weakref.ref(model), *(weakref.ref(p) for p in model.parameters())])
        initialize(model)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory (the test)")

    monkeypatch.setattr(probe, "reinitialize", recorded)  # the name the probe calls
    probe.probe(config, torch.float32, "cpu", activations.LENGTHS)
    monkeypatch.setattr(decoder_layers(meta_model(config))[-1].__class__, "forward", lambda *a, **k: out_of_memory(*a))
    with pytest.raises(torch.OutOfMemoryError):
        probe.probe(config, torch.float32, "cpu", activations.LENGTHS)
    gc.collect()
    assert len(built) == 2 and all(ref() is None for refs in built for ref in refs)


def test_the_probe_runs_the_jobs_precision_autocast_keeps_a_float32_residual_stream(tmp_path, monkeypatch):
    """A job without FSDP keeps float32 weights and computes under autocast: its residual stream and the
    norm inputs saved from it stay float32. The probe measures in that precision (cached apart from the
    bf16 one); in bf16 weights, as FSDP gathers them, every saved tensor is bf16."""
    config = tiny_llama(2)
    config._attn_implementation = "eager"

    probe_on_the_cpu(monkeypatch, tmp_path)
    amp = activations.measure(config, torch.bfloat16, autocast=True)
    bf16 = activations.measure(config, torch.bfloat16)
    assert "float32 weights under bfloat16 autocast" in amp.method and "bfloat16 weights" in bf16.method
    assert len(list((tmp_path / "activations").glob("*.json"))) == 2
    hidden = config.hidden_size
    for amp_block, bf16_block in zip(amp.blocks, bf16.blocks):
        # at least the block's input and its first norm's input, two more bytes an element each
        assert amp_block.linear >= bf16_block.linear + 2 * hidden * 2


def test_an_autocast_jobs_hf_model_is_probed_where_it_runs_and_keeps_its_meta_profile_if_that_fails(tmp_path,
                                                                                                     monkeypatch):
    """Autocast does not reach meta tensors: the meta forward keeps every tensor in bf16. On a GPU (the CPU
    here) an autocast job's HF model is measured as it runs; a probe that fails leaves the meta profile."""
    config = tiny_llama(2)
    config._attn_implementation = "eager"
    monkeypatch.setattr(activations, "_PROFILES", {})
    on_meta = activations.measure(config, torch.bfloat16, autocast=True)  # no GPU: the meta forward's answer
    assert on_meta.method.startswith("measured (meta-device forward")
    monkeypatch.setattr(probe, "probe_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(probe, "PROBE_LENGTHS", activations.LENGTHS)
    monkeypatch.setenv("FLAME_CACHE", str(tmp_path / "measured"))
    monkeypatch.setattr(activations, "_PROFILES", {})
    probed = activations.measure(config, torch.bfloat16, autocast=True)
    assert probed.method.startswith("measured (on the cpu, float32 weights under bfloat16 autocast")
    assert probed == probe.probe(config, torch.bfloat16, "cpu", activations.LENGTHS, autocast=True)
    assert all(mine.linear > theirs.linear for mine, theirs in zip(probed.blocks, on_meta.blocks))  # the fp32 stream

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (the test)")

    monkeypatch.setattr(probe, "probe", out_of_memory)
    monkeypatch.setenv("FLAME_CACHE", str(tmp_path / "failed"))
    monkeypatch.setattr(activations, "_PROFILES", {})
    fallback = activations.measure(config, torch.bfloat16, autocast=True)
    assert dataclasses.replace(fallback, method="") == dataclasses.replace(on_meta, method="")
    assert fallback.method.endswith("the GPU probe failed: OutOfMemoryError: CUDA out of memory (the test)")


def test_the_peak_is_the_forwards_end_or_the_backward_not_both(long_model, monkeypatch):
    """At the forward's end the loss's logits are live and the gradients not yet allocated (unless a step
    accumulates them); in the backward the gradients are and the logits are not. Counting both at once
    overestimated full AC by a sixth on the GPU (gla 340M)."""
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 1), fused_loss=True)

    def parts(job, layout):
        return {part.name: part for part in estimate(job, layout)}

    # no AC: the activations are the same at both moments; the loss's chunk of logits outweighs the gradients
    wide = dataclasses.replace(job, vocab_size=64 * job.params // min(job.rows * job.tokens_per_row, 8192))
    at_end = parts(wide, Layout())
    assert "the forward's end" in at_end["activations"].note
    assert at_end["gradients"].bytes == 0 and "allocated in the backward" in at_end["gradients"].note
    accumulating = parts(dataclasses.replace(wide, accumulates=True), Layout())
    assert accumulating["gradients"].bytes == 4 * job.params
    assert not job.expandable_segments  # a CPU job: the default segments' margin
    assert gpu_bytes(accumulating.values()) == pytest.approx(gpu_bytes(at_end.values()) + (1 + MARGINS[(False, ONE_GPU)]) * 4 * job.params)
    # full AC with a small vocabulary: the last block's recompute in the backward is the peak, without the logits
    narrow = dataclasses.replace(job, vocab_size=8)
    in_backward = parts(narrow, Layout(ac="full"))
    forward_end, backward = activation_moments(narrow, "full")
    assert backward > forward_end and "the backward's peak" in in_backward["activations"].note
    assert in_backward["activations"].bytes == pytest.approx(narrow.rows * backward)
    # the gradients allocated so far: the last block's, whose backward comes first
    assert in_backward["gradients"].bytes == 4 * job.block_params and "the last block's" in in_backward["gradients"].note
    assert "logits are freed" in in_backward["loss"].note


class _CastCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Each cast of a float32 weight (autocast's copies) made under this mode: (the weight's index, a weak reference)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.index = {weight.untyped_storage()._cdata: i for i, weight in enumerate(weights)}
        self.copies: list[tuple[int, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and (i := self.index.get(args[0].untyped_storage()._cdata)) is not None:
            self.copies.append((i, weakref.ref(out)))
        return out

    def alive(self) -> list[int]:
        gc.collect()
        return sorted(i for i, ref in self.copies if ref() is not None)


@pytest.mark.parametrize("checkpointed", [(), (0, 1), (0,)], ids=["none", "full", "first_1"])
def test_autocast_copies_outlive_the_forward_only_in_the_blocks_kept_whole(checkpointed):
    """What the estimate's moments rest on (``autocast_copies``), on the CPU's autocast, which caches weight casts
    as CUDA's does: every copy lives to the end of the autocast region; the backward runs after it, where only
    the blocks kept whole still hold their copies (saved for their backward), and a checkpointed block casts
    again when recomputed, its copies gone with its backward."""
    model = meta_model(tiny_llama(2))
    model.to_empty(device="cpu")
    builder.reinitialize(model)
    blocks = decoder_layers(model)
    for index in checkpointed:
        blocks[index].forward = functools.partial(torch.utils.checkpoint.checkpoint, blocks[index].forward,
                                                  use_reentrant=False)
    matrices = [weight for block in blocks for weight in block.parameters() if weight.dim() == 2]
    per_block = len(matrices) // 2
    ids = torch.randint(0, 4096, (1, 16))
    with _CastCopies(matrices) as casts, torch.autocast("cpu", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
        assert casts.alive() == list(range(2 * per_block))  # cast once each, all cached
    whole = [i for i in range(2 * per_block) if i // per_block not in checkpointed]
    assert casts.alive() == whole
    with casts:
        loss.backward()
    assert casts.alive() == []


def test_the_backward_counts_the_autocast_copies_of_the_blocks_not_yet_through_it(long_model, monkeypatch):
    """At the forward's end every weight's copy is live; at a block's backward, its own copy and those of the
    blocks before it kept whole (full AC of the 1B models counted every copy there: 8-12% over on an H200)."""
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 1), compute_bytes=2, autocast_copies=True, vocab_size=8)
    deep = dataclasses.replace(job, activations=job.activations.scaled(8))
    block_copy = 2 * deep.block_params
    assert autocast_copies(deep, Layout())[0] == 2 * deep.params
    assert autocast_copies(deep, Layout(ac="full"))[1] == [block_copy] * 8
    assert autocast_copies(deep, Layout(ac="op"))[1] == [block_copy] * 8
    # the first 5 recomputed: block k's backward sees its own copy and those of the whole blocks before it
    assert autocast_copies(deep, Layout(ac="first:5"))[1] == [block_copy] * 6 + [2 * block_copy, 3 * block_copy]
    assert autocast_copies(deep, Layout())[1] == [k * block_copy for k in range(1, 9)]
    assert autocast_copies(deep, Layout(ac="full", offload=True)) == (0.0, [0.0] * 8)
    parts = {part.name: part for part in estimate(deep, Layout(ac="full"))}
    assert "the backward's peak" in parts["activations"].note
    assert parts["autocast weight copies"].bytes == block_copy


def test_the_weights_average_is_counted_like_the_weights(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off", "--training.ema_decay=0.999"))
    job = memory.job_of(config, 1)
    parts = {part.name: part for part in estimate(job, Layout())}
    assert job.ema and parts["weights' average"].bytes == parts["parameters"].bytes == 4 * job.params
    without = {part.name for part in estimate(dataclasses.replace(job, ema=False), Layout())}
    assert "weights' average" not in without


def test_lora_holds_its_frozen_base_in_the_compute_dtype_without_gradients_or_optimizer_state(long_model, monkeypatch):
    """Under LoRA the base model's weights are frozen: on a GPU (bf16 mixed precision) they are held in bf16
    (flame.models.lora.hold_base_in) with no gradient, no AdamW moments and no autocast copy; only the adapters
    carry the float32 weight, gradient and state a trained weight does."""
    lora_flags = ("--memory.plan=off", "--lora.rank=4")
    full = memory.job_of(parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off")), 1)
    on_cpu = memory.job_of(parse_job(monkeypatch, 1, *job_args(long_model, *lora_flags)), 1)
    monkeypatch.setattr(memory.device, "CUDA", True)
    monkeypatch.setattr(activations, "measure", lambda *args, **kwargs: on_cpu.activations)
    job = memory.job_of(parse_job(monkeypatch, 1, *job_args(long_model, *lora_flags)), 1)
    adapters = on_cpu.params - full.params
    assert adapters > 0 and job.frozen_params == full.params and job.trainable_params == adapters
    assert (on_cpu.frozen_bytes, job.frozen_bytes) == (4, 2)  # a CPU computes in float32: its base stays float32
    parts = {part.name: part for part in estimate(job, Layout())}
    assert parts["parameters"].bytes == 2 * full.params + 4 * adapters
    assert parts["optimizer state"].bytes == 8 * adapters  # AdamW's two moments
    assert sum(part.bytes for part in estimate(job, Layout()) if part.name == "gradients") <= 4 * adapters
    # its embeddings held in bf16 too, the residual stream is bf16; autocast casts only the adapters (not counted)
    assert job.hidden_bytes == 2 and on_cpu.hidden_bytes == 4 and autocast_copies(job, Layout())[0] == 0
    full_on_gpu = dataclasses.replace(full, compute_bytes=2, autocast_copies=True, frozen_bytes=2)
    assert price(job, Layout(), H100).compute < price(full_on_gpu, Layout(), H100).compute  # no weight gradients
    assert gpu_bytes(estimate(job, Layout())) < gpu_bytes(estimate(full_on_gpu, Layout()))


def test_checkpointed_inputs_parked_on_the_host_free_their_memory_and_the_plan_takes_them_last(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    formula = activations._formula(load_model_config(long_model), torch.float32, 8, "reached Triton kernel k")
    job = dataclasses.replace(memory.job_of(config, 1), can_park_inputs=True, activations=formula)  # 8 blocks, a GPU's
    start = memory.layout_of(config)
    full, parked = Layout(ac="full"), Layout(ac="full", park_inputs=True)
    blocks = len(job.activations.blocks)
    inputs = job.activations.block_input * job.tokens_per_row * job.rows  # one block's input, every row
    host = {part.name: part for part in estimate(job, parked)}["parked block inputs"]
    assert host.bytes == pytest.approx((blocks - 1) * inputs) and host.where == "host (pinned)"  # the last keeps its own
    # every input but the last two (the last block's own; the one fetched back ahead of the backward)
    assert activation_bytes(job, "full") - max(backward_bytes(job, "full", True)) == pytest.approx(6 * inputs / job.rows)
    assert gpu_bytes(estimate(job, parked)) < gpu_bytes(estimate(job, full))
    # only where full AC keeps inputs; given, the setting is kept; on a CPU job never offered
    layouts = candidates(job, start, set(), None)
    assert parked in layouts and Layout(park_inputs=True) not in layouts
    assert not any(layout.park_inputs for layout in candidates(memory.job_of(config, 1), start, set(), None))
    # a budget full AC alone misses by less than the inputs: parked inputs, at the price of their copies
    budget = gpu_bytes(estimate(job, parked))
    plan = choose(job, start, {"micro_batches"}, budget, None, rates=lambda: H100)
    assert plan.layout.park_inputs and gpu_bytes(plan.parts) <= budget
    memory.set_layout(config, start, plan.layout)
    assert config.activation_checkpoint.offload and memory.layout_of(config).park_inputs


def test_a_mixture_of_experts_is_priced_by_its_active_parameters(monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args("configs/tiny/qwen3_moe.json", "--memory.plan=off"))
    job = memory.job_of(config, 1)
    model = meta_model(load_model_config("configs/tiny/qwen3_moe.json"))
    experts = sum(w.numel() for w in moe.expert_weights(model))  # 8 experts a layer, 2 a token
    assert job.params == sum(p.numel() for p in model.parameters()) and job.computed_params == job.params - experts * 3 // 4
    dense = dataclasses.replace(job, active_params=None)
    assert price(job, Layout(), H100).compute < price(dense, Layout(), H100).compute


def test_full_ac_keeps_less_than_op_level_which_keeps_less_than_none(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = memory.job_of(config, 1)
    none, op, full = (activation_bytes(job, ac) for ac in ("none", "op", "full"))
    assert full < op < none
    assert activation_bytes(job, "1") == full  # every block checkpointed
    # the last block's backward follows its forward at once: checkpointing it alone saves nothing
    assert activation_bytes(job, "2") == none
    deeper = dataclasses.replace(job, activations=job.activations.scaled(4))
    assert activation_bytes(deeper, "full") < activation_bytes(deeper, "2") < activation_bytes(deeper, "none")


# rates as measured on an H100 machine; there the tiny models' passes are host-bound (their launches take longer
# than their matmuls), as a large model's are not: GPU_BOUND prices them as if launches cost nothing
H100 = Hardware("NVIDIA H100 80GB HBM3", {256: 224.0, 1024: 559.0, 4096: 722.0, 16384: 764.0}, 54.7, 0.79e9, 6.4e-6)
GPU_BOUND = dataclasses.replace(H100, launch_seconds=0.0)
FAST_LINK = dataclasses.replace(H100, host_link_gbps=500.0, host_adam_params_per_s=2.0e10)


def fitting(job, start, budget, fixed=frozenset()):
    """Every layout the plan may take that fits ``budget``, with its price on the H100."""
    return [(layout, price(job, layout, H100).seconds) for layout in candidates(job, start, set(fixed), None)
            if gpu_bytes(estimate(job, layout)) <= budget]


def test_fsdp_resharding_is_weighed_unless_given(long_model, monkeypatch):
    config = parse_job(monkeypatch, 2, *job_args(long_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 2), can_offload=True)  # as on a GPU
    gathered = Layout(reshard=False)  # as under pipeline parallelism, or fsdp_reshard_after_forward never
    assert {layout.reshard for layout in candidates(job, gathered, set(), None)} == {False, True}
    assert {layout.reshard for layout in candidates(job, gathered, {"reshard"}, None)} == {False}
    assert gpu_bytes(estimate(job, gathered)) > gpu_bytes(estimate(job, Layout()))
    # resharding gathers the weights again in the backward: it costs time, so the plan takes it only to fit
    assert price(job, Layout(), H100).gathers == 2 * price(job, gathered, H100).gathers > 0
    # a job that fits: kept as it is, but for the weights kept gathered where that fits too
    roomy = choose(job, Layout(), set(), gpu_bytes(estimate(job, gathered)), None, rates=lambda: H100)
    assert roomy.layout == gathered and "kept gathered after the forward" in roomy.why
    tight = choose(job, Layout(), set(), gpu_bytes(estimate(job, Layout())), None, rates=lambda: H100)
    assert tight.layout == Layout() and tight.why == "fits as configured"
    given = choose(job, Layout(), {"reshard"}, gpu_bytes(estimate(job, gathered)), None, rates=lambda: H100)
    assert given.layout == Layout()
    memory.set_layout(config, Layout(), gathered)
    assert config.parallelism.fsdp_reshard_after_forward == "never"


def test_plan_takes_the_cheapest_layout_that_fits_and_costs_more_as_the_budget_shrinks(long_model, monkeypatch):
    config = parse_job(monkeypatch, 2, *job_args(long_model, "--memory.plan=off"))  # FSDP over 2 ranks
    job, start = dataclasses.replace(memory.job_of(config, 2), can_offload=True), memory.layout_of(config)  # as on a GPU
    every = candidates(job, start, set(), None)
    assert len(every) == 3 * 2 * 4  # AC none, of the first block, full; offload or not; 1, 2, 4, 8 micro-batches
    needs = sorted({gpu_bytes(estimate(job, layout)) for layout in every}, reverse=True)
    chosen, prices = [], []
    for need in needs:
        plan = choose(job, start, set(), need, None, rates=lambda: H100)
        assert plan.fits and plan.gpu_bytes <= need
        if plan.layout == start:
            continue  # fits as configured: not priced
        mine = price(job, plan.layout, H100).seconds
        cheapest = min(seconds for _, seconds in fitting(job, start, need))
        assert cheapest <= mine <= cheapest * (1 + PRICE_TOLERANCE)
        # the line says which: the cheapest, or one priced alike that changes the job less
        said = "the cheapest of" if mine == cheapest else f"priced within 5% of the cheapest ({cheapest:.3g} s)"
        assert said in plan.why or "the only layout that fits" in plan.why, plan.why
        chosen.append(plan.layout)
        prices.append(mine)
    assert prices == sorted(prices)  # a smaller budget never buys a faster step
    described = list(dict.fromkeys(layout.describe() for layout in chosen))
    # full AC of the first block keeps what full AC keeps at its peak (the second block's backward, its
    # activations recomputed) and recomputes less: full AC of both is never the cheapest
    assert "full AC of the first block" in described and "full AC" not in described
    assert described[-1] == "full AC of the first block, CPU offload, 8 micro-batches"
    # this tiny model's passes are host-bound: a second micro-batch costs a whole pass, more than any
    # layout of one pass, so every layout of one pass comes first
    passes = [layout.micro_batches for layout in chosen]
    assert passes == sorted(passes) and passes[0] == 1 and passes[-1] == 8
    roomy = choose(job, start, set(), needs[len(needs) // 2], None, rates=lambda: H100)
    shown = table(roomy, job.activations.method).splitlines()[-1]
    assert shown.startswith("next cheapest that fit: ") and shown.count(" s, ") == 3, shown
    plan = choose(job, start, set(), needs[-1], None, rates=lambda: H100)
    shown = table(plan, job.activations.method)
    # the most memory-saving layout: the only other that fits is full AC of both blocks, as large and dearer
    assert shown.splitlines()[-1].startswith("next cheapest that fit: full AC, CPU offload, 8 micro-batches ")
    assert shown.splitlines()[-1].count(" s, ") == 1
    for part in ("parameters", "gradients", "optimizer state", "FSDP all-gather buffers", "activations",
                 "loss", "allocator margin", "host (CPU offload)",
                 "plan: full AC of the first block, CPU offload, 8 micro-batches",
                 "its step priced: passes", "rates measured on NVIDIA H100 80GB HBM3"):
        assert part in shown


def test_rates_are_asked_for_only_when_there_is_a_choice(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(config, 1), memory.layout_of(config)

    def unmeasured():
        raise AssertionError("measured the hardware for a job that fits")

    plan = choose(job, start, set(), 1.01 * gpu_bytes(estimate(job, start)), None, rates=unmeasured)
    assert plan.layout == start and plan.why == "fits as configured"


def test_a_host_bound_pass_recomputes_rather_than_splits_and_a_gpu_bound_one_splits(long_model, monkeypatch):
    """A second micro-batch costs a host-bound model a whole pass's launches, more than recomputing; a
    GPU-bound model only its smaller matmuls' lower rate, less than a second forward."""
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 1), can_offload=True, compute_bytes=2, autocast_copies=True)
    start, full = memory.layout_of(config), Layout(ac="first:1")  # one GPU in bf16; of 2 blocks, one recomputed
    budget = gpu_bytes(estimate(job, full))
    assert choose(job, start, set(), budget, None, rates=lambda: H100).layout == full
    # 8 blocks (fla's formula), 7 recomputed: what fits where full AC does
    deep = dataclasses.replace(job, activations=activations._formula(load_model_config(long_model), torch.float32, 8,
                                                                     "reached Triton kernel k"))
    seven = Layout(ac="first:7")
    deep_budget = gpu_bytes(estimate(deep, seven))
    split = choose(deep, start, set(), deep_budget, None, rates=lambda: GPU_BOUND).layout
    assert split.micro_batches > 1 and not split.offload, split
    assert price(deep, split, GPU_BOUND).seconds * (1 + PRICE_TOLERANCE) < price(deep, seven, GPU_BOUND).seconds
    # with the micro-batches given, a GPU-bound pass recomputes too
    assert choose(deep, start, {"micro_batches"}, deep_budget, None, rates=lambda: GPU_BOUND).layout == seven
    # offload: the weights, gradients and optimizer state move to the host; FSDP's bf16 copies of one block and
    # its prefetch replace autocast's copy of every weight
    offloaded = Layout(ac="first:1", offload=True)
    names = {part.name: part for part in estimate(job, offloaded)}
    assert {names[n].where for n in ("parameters", "gradients", "optimizer state")} == {"host (CPU offload)"}
    assert "autocast weight copies" not in names and names["FSDP all-gather buffers"].bytes == 2 * 2 * job.block_params
    assert "autocast weight copies" in {part.name for part in estimate(job, Layout(ac="full"))}
    # a budget only offload fits, micro-batches given: offload, priced at the host link's rate (weights 20 times
    # as many: what offload frees then outweighs the larger margin FSDP's streams take)
    heavy = dataclasses.replace(job, params=20 * job.params)
    budget = gpu_bytes(estimate(heavy, offloaded))
    assert choose(heavy, start, {"micro_batches"}, budget, None, rates=lambda: H100).layout == offloaded
    slow, fast = (price(job, offloaded, rates).offload for rates in (H100, FAST_LINK))
    assert slow > 10 * fast > 0


def test_the_plan_checkpoints_the_first_k_blocks_for_any_k_and_never_takes_op_level_ac(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    measured, start = memory.job_of(config, 1), memory.layout_of(config)
    assert {layout.ac for layout in candidates(measured, start, set(), None)} == {"none", "first:1", "full"}
    formula = activations._formula(load_model_config(long_model), torch.float32, 8, "reached Triton kernel k")
    job = dataclasses.replace(measured, activations=formula)  # as for fla's models: 8 blocks of Triton kernels
    firsts = [f"first:{count}" for count in range(1, 8)]
    assert {layout.ac for layout in candidates(job, start, set(), None)} == {"none", *firsts, "full"}
    needs = [gpu_bytes(estimate(job, Layout(ac=ac))) for ac in ("none", *firsts)]
    assert needs == sorted(needs, reverse=True) and len(set(needs)) == 8  # each recomputes more and keeps less
    # the last block kept whole: its backward, which comes first, needs what a recomputed one would
    assert gpu_bytes(estimate(job, Layout(ac="first:7"))) == gpu_bytes(estimate(job, Layout(ac="full")))
    # torchtitan's every-N-th-block AC keeps more for as much recomputed (it recomputes the last block)
    assert gpu_bytes(estimate(job, Layout(ac="2"))) > gpu_bytes(estimate(job, Layout(ac="first:4")))
    seconds = [price(job, Layout(ac=ac), H100).seconds for ac in ("none", *firsts, "full")]
    assert seconds == sorted(seconds) and len(set(seconds)) == 9
    plan = choose(job, start, {"micro_batches"}, needs[3], None, rates=lambda: H100)
    assert plan.layout.ac == "first:3"
    memory.set_layout(config, start, plan.layout)
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.blocks) == ("full", 3)
    assert memory.layout_of(config).ac == "first:3"
    # a setting that already recomputes more is not undone; op-level AC given is priced as full AC
    assert {layout.ac for layout in candidates(job, Layout(ac="first:6"), set(), None)} == {"first:6", "first:7", "full"}
    assert price(job, Layout(ac="op"), H100) == price(job, Layout(ac="full"), H100)
    # pipeline stages split the blocks: there, torchtitan's every-N-th block
    staged = dataclasses.replace(job, pipelined=True)
    assert {layout.ac for layout in candidates(staged, start, set(), None)} == {"none", "4", "3", "2", "full"}


def test_a_cpu_never_offloads_and_muon_never_does(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    on_cpu, start = memory.job_of(config, 1), memory.layout_of(config)
    assert not on_cpu.fsdp and not any(layout.offload for layout in candidates(on_cpu, start, set(), None))
    muon = dataclasses.replace(on_cpu, can_offload=True, optimizer=MUON)  # Muon orthogonalizes whole matrices on the GPU
    assert not any(layout.offload for layout in candidates(muon, start, set(), None))


def test_the_hardware_is_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAME_CACHE", str(tmp_path))
    monkeypatch.delenv("FLAME_HARDWARE", raising=False)
    measured = hardware.load(torch.float32)
    assert hardware.cache_path(torch.float32).is_file()
    assert all(tflops > 0 for tflops in measured.matmul_tflops.values()) and measured.host_adam_params_per_s > 0
    assert measured.host_link_gbps is None and measured.launch_seconds > 0  # a CPU has no host link to price
    assert hardware.load(torch.float32) == measured  # read back, not measured again
    monkeypatch.setenv("FLAME_HARDWARE", str(hardware.cache_path(torch.float32)))
    assert hardware.load(torch.bfloat16) == measured  # the file given, whatever this machine would measure
    monkeypatch.setenv("FLAME_HARDWARE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="FLAME_HARDWARE=.*missing.json is not a rates file flame wrote"):
        hardware.load(torch.float32)
    rates = Hardware("x", {256: 100.0, 4096: 400.0}, None, 1.0, 1e-6)
    assert rates.tflops(100) == 100.0 and rates.tflops(10**5) == 400.0 and rates.tflops(1024) == pytest.approx(250.0)


def test_the_measuring_command_caches_the_rates_and_refuses_an_unknown_dtype(tmp_path):
    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flame.memory.hardware", *args], cwd=ROOT, capture_output=True,
                              text=True, env=flame_env() | {"FLAME_CACHE": str(tmp_path)}, timeout=300)

    measured = command("float32")
    assert measured.returncode == 0, measured.stderr
    cached = list((tmp_path / "hardware").glob("*-cpu-*-float32.json"))
    assert len(cached) == 1 and f"cached in {cached[0]}" in measured.stdout
    assert hardware.read(cached[0]).describe() in measured.stdout
    refused = command("float64")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "flame: error: 'float64' is not a compute dtype: give one of bfloat16, float16, float32"


@pytest.fixture
def h100_rates(tmp_path, monkeypatch):
    """Plans priced at the H100's rates (FLAME_HARDWARE), so what they choose does not depend on this CPU."""
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(dataclasses.asdict(H100)))
    monkeypatch.setenv("FLAME_HARDWARE", str(path))


def test_a_planned_job_config_carries_the_plan_and_keeps_the_global_batch(long_model, monkeypatch, h100_rates):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = memory.job_of(off, 1)
    budget = 1.001 * gpu_bytes(estimate(job, Layout(micro_batches=2))) / GIB  # printed to 6 places: a hair above
    planned = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={budget:.6f}"))
    t = planned.training
    # one process gathers nothing again for a second micro-batch: it costs less than recomputing (test above)
    assert (planned.activation_checkpoint.mode, t.local_batch_size, t.gradient_accumulation_steps) == ("none", 4, 2)
    assert t.global_batch_size == off.training.global_batch_size == 8


def test_a_job_that_fits_no_plan_is_refused_in_one_line_naming_the_smallest_budget(long_model, monkeypatch, h100_rates):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(off, 1), memory.layout_of(off)
    smallest = min(gpu_bytes(estimate(job, layout)) for layout in candidates(job, start, set(), None)) / GIB
    with pytest.raises(ConfigError) as error:
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.gpu_budget_gib=0.001"))
    message = str(error.value)
    assert "\n" not in message and "does not fit the 0.00 GiB GPU budget" in message
    assert f"--memory.gpu_budget_gib {math.ceil(smallest * 100) / 100:.2f}" in message


def test_settings_given_are_kept(long_model, monkeypatch, h100_rates):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = memory.job_of(off, 1)
    full = 1.001 * gpu_bytes(estimate(job, Layout(ac="full"))) / GIB
    # a budget AC fits: with --activation_checkpoint.mode none, the plan takes micro-batches instead
    kept = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full:.6f}",
                                               "--activation_checkpoint.mode=none"))
    assert kept.activation_checkpoint.mode == "none" and kept.training.gradient_accumulation_steps > 1
    given = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full:.6f}",
                                                "--training.gradient_accumulation_steps=1"))
    assert (given.activation_checkpoint.mode, given.activation_checkpoint.blocks) == ("full", 1)
    assert given.training.local_batch_size == 8
    with pytest.raises(ConfigError, match="does not fit") as refused:  # the only way left would be micro-batches
        parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full * 0.9:.6f}",
                                            "--training.gradient_accumulation_steps=1"))
    # which the refusal names as the remedy: the setting the job gives, which the plan kept
    assert str(refused.value).endswith("; or leave --training.gradient_accumulation_steps out of the job file and the "
                                       "command line: the plan keeps what the job gives, and without it fits the job "
                                       "(no AC, 2 micro-batches)"), str(refused.value)


def test_plan_off_changes_nothing_and_takes_no_budget(long_model, monkeypatch):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    assert (off.activation_checkpoint.mode, off.training.local_batch_size, off.training.gradient_accumulation_steps,
            off.training.enable_cpu_offload) == ("none", 8, 1, False)
    with pytest.raises(ConfigError, match="--memory.gpu_budget_gib is a budget for the memory plan, and --memory.plan is off"):
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off", "--memory.gpu_budget_gib=1"))
    with pytest.raises(ConfigError, match="--memory.gpu_budget_gib must be auto or a positive number of GiB, got 'x'"):
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.gpu_budget_gib=x"))


def test_micro_batched_plan_trains_the_same_loss_curve(tiny_model, corpus, tmp_path, monkeypatch, h100_rates):
    # 4 rows of 64 tokens: their activations and logits outweigh the gradients that micro-batches keep all step;
    # AC given as none, which the plan keeps: micro-batches are what is left to fit the budget
    args = [*base_args(tiny_model, corpus, tmp_path / "x", steps=3)[:-1], "--training.batch_size=4",
            "--activation_checkpoint.mode=none"]
    off = parse_job(monkeypatch, 1, *args, f"--job.dump_folder={tmp_path / 'off'}", "--memory.plan=off")
    job = memory.job_of(off, 1)
    assert gpu_bytes(estimate(job, Layout(micro_batches=2))) < gpu_bytes(estimate(job, Layout()))
    budget = f"--memory.gpu_budget_gib={1.001 * gpu_bytes(estimate(job, Layout(micro_batches=2))) / GIB:.9f}"
    reference, planned = two_at_a_time(
        lambda: torchrun([*args, f"--job.dump_folder={tmp_path / 'off'}", "--memory.plan=off"]),
        lambda: torchrun([*args, f"--job.dump_folder={tmp_path / 'planned'}", budget]),
    )
    for result in (reference, planned):
        assert result.returncode == 0, result.stderr[-4000:]
    log = planned.stdout + planned.stderr
    assert "Memory plan" in log and "plan: no AC, 2 micro-batches" in log and "optimizer state" in log
    assert "Memory plan" not in reference.stdout + reference.stderr
    assert len(losses(tmp_path / "planned")) == 3
    assert_same_curve(losses_and_norms(tmp_path / "planned"), losses_and_norms(tmp_path / "off"), rel=1e-5)


def losses_and_norms(dump) -> dict[int, dict]:
    return {step: row for step, row in metrics(dump).items() if "grad_norm" in row}


def test_ranks_that_plan_apart_stop_before_the_first_step(tiny_model, corpus, tmp_path, monkeypatch):
    """Rank 0 prices at the H100's rates (the tiny model's passes are host-bound: recomputing costs less than
    another pass), rank 1 on a machine whose matmuls are so slow that recomputing costs more than FSDP's
    gathers for a second micro-batch: their plans differ."""
    slow = Hardware("slow", {256: 0.001, 16384: 0.001}, 25.0, 1.0e9, 0.0)
    for rank, rates in enumerate((H100, slow)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(dataclasses.asdict(rates)))
    args = [*base_args(tiny_model, corpus, tmp_path / "run", steps=2)[:-1], "--training.batch_size=4"]
    off = parse_job(monkeypatch, 2, *args, "--memory.plan=off")
    job, start = memory.job_of(off, 2), memory.layout_of(off)
    budget = 0.999 * gpu_bytes(estimate(job, start)) / GIB  # just under: the job must choose
    plans = [choose(job, start, set(), budget * GIB, None, rates=lambda r=r: r).layout for r in (H100, slow)]
    assert plans[0].ac != "none" and plans[0].micro_batches == 1 and plans[1].ac == "none" and plans[1].micro_batches > 1
    result = torchrun([*args, f"--memory.gpu_budget_gib={budget:.9f}"], nproc=2, module=str(ROOT / "tests/scripts/plans_apart.py"),
                      env={"FLAME_TEST_RATES": str(tmp_path)})
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert "the memory plan differs between ranks (--activation_checkpoint.mode full on rank 0, none on rank 1" in log
    assert "--training.gradient_accumulation_steps 1 on rank 0, 2 on rank 1" in log
    assert "set FLAME_HARDWARE on every node" in log
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the first step


def test_planned_jobs_take_an_allocator_whose_reserve_follows_their_tensors_and_a_margin_to_match(long_model,
                                                                                                   monkeypatch):
    """On a GPU the plan sets expandable segments for its own process (the check, every rank, however
    started) before CUDA starts, and counts 8% for fragmentation (20% where FSDP's streams gather and
    reduce over ranks, 15% where they copy for one process's rank); a user's own allocator setting is kept, with
    the default segments' 10%."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(memory.device, "CUDA", True)
    monkeypatch.setattr(memory, "budgets", lambda config: (None, None))  # no GPU here to measure

    def planned(*flags, layout=Layout()):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        config = parse_job(monkeypatch, 1, *job_args(long_model, *flags))
        job = memory.job_of(config, 1)
        margin = next(part for part in estimate(job, layout) if part.name == "allocator margin")
        return os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), margin.note

    assert planned("--memory.plan=auto") == ("expandable_segments:True", "8% fragmentation (expandable segments)")
    assert planned("--memory.plan=off") == (None, "10% fragmentation (the allocator's default segments)")
    # CPU offload wraps the one process's model in FSDP, whose copies run on streams of their own (no collectives)
    assert planned("--memory.plan=auto", layout=Layout(offload=True))[1] == \
        "15% fragmentation (expandable segments, FSDP's streams over one rank)"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own is kept
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=auto"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert not memory.job_of(config, 1).expandable_segments

def test_a_model_whose_forward_launches_triton_kernels_is_planned_with_room_for_their_tuning(long_model, tmp_path,
                                                                                           monkeypatch):
    """fla's kernels time their configurations at their first call on a new machine, and what those load stays
    outside PyTorch's allocator: gla 340M's plan, 0.8 GiB inside an H100's budget without this, ran out of memory at
    step 2 of its first run. A model the meta forward can run (no Triton kernel of its own) gets no such room."""
    monkeypatch.setattr(memory.device, "CUDA", True)
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    plain = {part.name: part for part in estimate(memory.job_of(config, 1), Layout())}
    probe_on_the_cpu(monkeypatch, tmp_path)  # the meta forward refused, as a Triton kernel refuses it
    tuned = {part.name: part for part in estimate(memory.job_of(config, 1), Layout())}
    assert "kernels' tuning" not in plain
    assert tuned["kernels' tuning"].bytes == 2 * GIB and tuned["kernels' tuning"].where == "GPU"
    rest = [part for name, part in tuned.items() if name != "kernels' tuning"]
    assert gpu_bytes(list(tuned.values())) == pytest.approx(gpu_bytes(rest) + 2 * GIB)  # in the total the plan fits


def test_one_process_offloading_or_stepping_on_the_host_is_planned_as_fsdp_over_its_one_rank(long_model, tmp_path,
                                                                                            monkeypatch):
    """One GPU process without FSDP computes under autocast: float32 weights with a bf16 copy of each, and a
    float32 residual stream. CPU offload and the optimizer on the host wrap it in FSDP over its one rank
    (degrees.fsdp_alone), which casts a block's weights at a time and keeps the stream in bf16: those layouts
    are estimated as they run, their activations measured again in bf16 weights."""
    probe_on_the_cpu(monkeypatch, tmp_path)
    monkeypatch.setattr(memory.device, "CUDA", True)
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = memory.job_of(config, 1)
    assert job.autocast_copies and not job.fsdp and "float32 weights under bfloat16 autocast" in job.activations.method
    plain, on_host = ({part.name: part for part in estimate(job, layout)}
                      for layout in (Layout(), Layout(host_optimizer=True)))
    assert "autocast weight copies" in plain and "autocast weight copies" not in on_host
    assert on_host["FSDP all-gather buffers"].note == "one block and its prefetch"
    assert "FSDP's streams" in on_host["allocator margin"].note and "streams" not in plain["allocator margin"].note
    wrapped = job.wrapped()
    assert wrapped.fsdp and "bfloat16 weights" in wrapped.activations.method and wrapped is job.wrapped()
    assert all(bf16.linear < amp.linear for bf16, amp in zip(wrapped.activations.blocks, job.activations.blocks))
    assert on_host["activations"].bytes < plain["activations"].bytes
    # a job already given the flag is FSDP over its rank from the start: nothing to wrap
    given = memory.job_of(parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off", "--optimizer.on_host")), 1)
    assert given.fsdp and given.wrapped is None and not given.autocast_copies
    assert gpu_bytes(estimate(given, Layout(host_optimizer=True))) == gpu_bytes(estimate(job, Layout(host_optimizer=True)))


def seven_b_on_an_h100() -> tuple[memory.Job, Hardware]:
    """transformer_7B at 8 rows of 32K tokens on one H100, as that H100 measured it: its activations in bf16 weights
    (a block keeps 109,448 bytes a token, its input 8,192; the backward's buffers 88,061 a token) and its rates."""
    register_all()
    model = meta_model(load_model_config(str(ROOT / "configs" / "transformer_7B.json")))
    params, matrices, largest = memory.count_params(model, decoder_layers(model))
    blocks = len(decoder_layers(model))
    measured = activations.ActivationProfile((activations.Quadratic(109448, 1 / 12),) * blocks,
                                             (activations.Quadratic(40000),) * blocks, 8192, activations.Quadratic(16396),
                                             "measured", activations.Quadratic(88061))
    alone = memory.Job(params=params, matrix_params=matrices, block_params=largest, vocab_size=32000, hidden_size=4096,
                       compute_bytes=2, hidden_bytes=2, optimizer=ADAMW, rows=8, accumulates=False,
                       tokens_per_row=32768, weight_shards=1, fsdp=True, alone=True, can_offload=True,
                       can_step_on_host=True, gpu_state_params=0, autocast_copies=False, fused_loss=True,
                       expandable_segments=True, dense_attention=False, tensor_parallel=1, pipelined=False, ema=False,
                       activations=measured, offload_pinning=memory.offload_pinning(model, 1),
                       host_copy_pinning=memory.host_copy_pinning(model, 1),
                       resident_params=memory.stream_units(model)[0],
                       stream_pinning=memory.stream_pinning(memory.stream_units(model), 2))
    rates = Hardware("NVIDIA H100 80GB HBM3", {256: 238.0, 1024: 537.0, 4096: 723.0, 16384: 763.0}, 54.9, 5.62e9, 1e-5)
    return alone, rates


def test_transformer_7b_on_an_80_gb_gpu_steps_its_optimizer_on_the_host(monkeypatch):
    """The 7B at 8 rows of 32K tokens on one H100, planned from what that H100 measured. The optimizer on the host
    with 8 micro-batches ran there at 38.9% MFU and reserved 68.0 GiB; CPU offload, the next layout, at 21%. The choice between them rests on the one-rank margin: FSDP over 2 GPUs' 20% would
    price the host optimizer out."""
    alone, rates = seven_b_on_an_h100()
    plan = choose(alone, Layout(), set(), 78.18 * GIB, 110 * GIB, lambda: rates)
    assert plan.fits and plan.layout.host_optimizer and not plan.layout.offload and plan.layout.micro_batches == 8
    assert plan.gpu_bytes >= 68.0 * GIB  # what the run reserved under that layout
    # its pinned copies of the weights and gradients come in chunks: 3.6% over the 50.2 GiB they hold, where one
    # pinned buffer a block took a third more (PyTorch's pinned allocator rounds up to a power of two)
    assert alone.host_copy_pinning < 1.04 and host_bytes(plan.parts) < 103 * GIB
    # One 128K row cannot be split into micro-batches: only the weights streamed from the host fit the GPU. FSDP
    # pins each offloaded weight and gradient, rounded up (the MLP's 172 MiB to 256): 116 GiB with the optimizer's
    # state. On the H100 (128.9 GiB of RAM) the machine's used memory peaked at 125.5 GiB under this layout, the
    # process and its data workers beside it; the plan's default budget (90% of the available RAM) refuses it,
    # and says what it would need
    row = dataclasses.replace(alone, rows=1, tokens_per_row=131072)
    streamed = Layout(ac="full", offload=True, host_optimizer=True)
    assert gpu_bytes(estimate(row, streamed)) < 78.18 * GIB
    assert 1.3 < row.offload_pinning < 1.33 and 115 * GIB < host_bytes(estimate(row, streamed)) < 118 * GIB
    refused = choose(row, Layout(), set(), 78.18 * GIB, 110 * GIB, lambda: rates)
    assert not refused.fits and "CPU offload, optimizer on the host would fit the GPU but needs 116." in refused.remark
    assert "over the 110.0 GiB host budget (--memory.host_budget_gib" in refused.remark
    given = choose(row, Layout(), set(), 78.18 * GIB, 120 * GIB, lambda: rates)  # --memory.host_budget_gib 120
    assert given.fits and given.layout.offload and given.layout.host_optimizer and not given.remark
