"""transformers' hybrid models (flame.models.hybrid): in a packed batch every document gets the logits and
gradients it gets alone, on the CPU's per-document path and on the GPUs' varlen kernels (run here with CPU
stand-ins for fla's and mamba_ssm's kernels); without flame the documents leak into each other; an HF-saved
hybrid starts a run (--model.init_from), trains, and its export loads back in transformers with the run's logits.
"""

import importlib
import inspect
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from flame import compat
from flame.base import batch_context, device
from flame.base.batch_context import BatchContext
from flame.base.errors import ConfigError
from flame.compat import mamba_ssm
from flame.models import hybrid, load_model_config
from flame.models.builder import FlameModelArgs, build_model
from flame.models.inputs import batch_inputs
from flame.models.kernels import attention, mamba2, varlen
from flame.models.kernels import selective_scan as scans
from flame.models.kernels.selective_scan import document_conv
from flame.models.support import HYBRID, RECORDS
from tests.checkpoint.test_export import convert
from tests.conftest import ROOT, SCRIPTS, TOKENIZER, check, metrics, torchrun, two_at_a_time

HYBRIDS = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "nemotron_h", "falcon_h1", "granitemoehybrid",
           "bamba", "jamba", "lfm2"]
LENGTHS = [[5, 4, 7], [9, 7]]  # the documents of two rows of 16 tokens
ROWS, LENGTH = 2, 16
LOSS = "loss_metrics/global_avg_loss"


def _build(model_type: str) -> torch.nn.Module:
    path = str(ROOT / "configs" / "tiny" / f"{model_type}.json")
    args = FlameModelArgs(config_path=path, fused_kernels=False)
    args._config = load_model_config(path)
    torch.manual_seed(0)
    return build_model(args).eval()


def _batch() -> tuple[dict, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (ROWS, LENGTH + 1))
    documents = [n for row in LENGTHS for n in row]
    batch = {"input": ids[:, :-1], "position_ids": torch.cat([torch.arange(n) for n in documents]).view(ROWS, LENGTH),
             "cu_seqlens": torch.tensor([0, *itertools.accumulate(documents)], dtype=torch.int32),
             "max_seqlen": max(documents)}
    return batch, ids[:, 1:]


def _packed_logits(model, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    """The batch as the trainer computes it: flame's inputs, inside its batch context."""
    inputs, _, kwargs, context = batch_inputs(model, batch, labels, BatchContext())
    with batch_context.computing(context):
        return model(inputs, **kwargs).logits


def _separate_logits(model, batch: dict) -> torch.Tensor:
    """Each document alone, outside any batch: transformers' own computation."""
    ids, bounds = batch["input"].flatten(), batch["cu_seqlens"].tolist()
    logits = [model(ids[None, start:end], use_cache=False).logits for start, end in zip(bounds, bounds[1:])]
    return torch.cat(logits, dim=1).view(ROWS, LENGTH, -1)


def _mixers(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, hybrid.KeepsDocumentsApart)]


def test_every_transformers_hybrid_record_has_a_tiny_config_and_known_layers():
    recorded = {name for name, r in RECORDS.items() if r.library == "transformers" and r.family == HYBRID}
    assert recorded == {*HYBRIDS, "qwen3_5"}  # qwen3_5's causal LM is its text model, qwen3_5_text
    meta = {model_type: AutoModelForCausalLM.from_config(load_model_config(str(ROOT / f"configs/tiny/{model_type}.json")))
            for model_type in HYBRIDS}
    found = {type(m).__name__ for model in meta.values() for m in model.modules() if type(m).__name__ in hybrid.MIXERS}
    assert found == hybrid.MIXERS.keys()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_each_document_of_a_packed_batch_gets_its_logits_alone(model_type):
    model = _build(model_type)
    assert model.config._attn_implementation == attention.HF_ATTENTION
    assert _mixers(model) and not any(m.over_flattened_batch for m in _mixers(model))  # CPU: once per document
    batch, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_packed_logits(model, batch, labels), _separate_logits(model, batch),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_without_flame_the_documents_of_a_packed_batch_leak(model_type):
    model = _build(model_type)
    plain = AutoModelForCausalLM.from_config(model.config, attn_implementation=attention.HF_ATTENTION).eval()
    plain.load_state_dict(model.state_dict())
    batch, labels = _batch()
    inputs, _, kwargs, _ = batch_inputs(model, batch, labels, BatchContext())
    with torch.no_grad():
        # flame's attention keeps the documents apart by cu_seq_lens_q alone; the recurrent layers do not
        leaked = plain(inputs, **kwargs).logits
        separate = _separate_logits(model, batch)
    assert (leaked - separate)[:, :5].abs().max() < 1e-5  # the first document of each row sees nothing before it
    assert (leaked - separate).abs().max() > 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_each_document_of_a_packed_batch_gets_its_gradients_alone(model_type):
    model = _build(model_type).train()
    batch, labels = _batch()
    F.cross_entropy(_packed_logits(model, batch, labels).flatten(0, 1), labels.flatten(), reduction="sum").backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    separate = _separate_logits(model, batch)
    F.cross_entropy(separate.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)


# --- the GPUs' path: the layers over the flattened batch, their kernels restarting at each document ---------------


def _pieces(cu_seqlens: torch.Tensor) -> list[slice]:
    bounds = cu_seqlens.tolist()
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def _reference(module: str, kernel: str):
    """transformers' PyTorch code of a modeling module's kernel, under whatever wraps it."""
    return inspect.unwrap(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), kernel))


@pytest.fixture
def kernels_on_cpu(monkeypatch) -> list[str]:
    """fla's and mamba_ssm's varlen kernels as transformers' PyTorch code run on each document; the kernels called."""
    called = []

    def conv(x, weight, bias=None, activation=None, cu_seqlens=None):
        called.append("causal_conv1d")
        out = document_conv(x, weight, bias, cu_seqlens)
        return (F.silu(out) if activation else out), None

    def delta_rule(name, reference):
        def rule(q, k, v, g, beta, cu_seqlens, **options):
            called.append(name)
            return torch.cat([reference(q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s], **options)[0]
                              for s in _pieces(cu_seqlens)], dim=1), None
        return rule

    def ssd(x, dt, A, B, C, chunk_size, seq_idx, **options):
        called.append("ssd")
        counts = torch.unique_consecutive(seq_idx[0], return_counts=True)[1]
        pieces = _pieces(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
        reference = _reference("bamba", "mamba2_chunk_scan")
        return torch.cat([reference(x[:, s], dt[:, s], A, B[:, s], C[:, s], chunk_size, **options) for s in pieces], 1)

    fla_conv = importlib.import_module(varlen.CONV.module)
    monkeypatch.setattr(fla_conv, varlen.CONV.name, conv)
    for target, module, kernel in ((varlen.GATED_DELTA_RULE, "qwen3_5", "torch_chunk_gated_delta_rule"),
                                   (varlen.KIMI_DELTA_RULE, "kimi_linear", "chunk_kimi_delta_attention")):
        monkeypatch.setattr(importlib.import_module(target.module), target.name,
                            delta_rule(target.name, _reference(module, kernel)))
    monkeypatch.setattr(mamba_ssm, "ssd_scan", lambda: ssd)
    flame_scan = scans.selective_scan  # flame's own: its PyTorch loop on CPU tensors
    monkeypatch.setattr(scans, "selective_scan", lambda *args: called.append("selective_scan") or flame_scan(*args))
    monkeypatch.setattr(device, "CUDA", True)  # flame builds the model for GPUs
    return called


_GATED_DELTA, _MAMBA2 = ("causal_conv1d", "chunk_gated_delta_rule"), ("causal_conv1d", "ssd")
VARLEN_KERNELS = {"qwen3_5_text": _GATED_DELTA, "qwen3_next": _GATED_DELTA, "olmo_hybrid": _GATED_DELTA,
                  "kimi_linear": ("causal_conv1d", "chunk_kda"), "nemotron_h": _MAMBA2, "falcon_h1": _MAMBA2,
                  "granitemoehybrid": _MAMBA2, "bamba": _MAMBA2, "jamba": ("causal_conv1d", "selective_scan"),
                  "lfm2": ("causal_conv1d",)}


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_on_gpus_the_layers_run_over_the_flattened_batch_on_kernels_that_restart_per_document(kernels_on_cpu,
                                                                                              model_type):
    model = _build(model_type)
    assert all(m.over_flattened_batch for m in _mixers(model))
    batch, labels = _batch()
    with torch.no_grad():
        packed = _packed_logits(model, batch, labels)
        assert set(kernels_on_cpu) == set(VARLEN_KERNELS[model_type])
        torch.testing.assert_close(packed, _separate_logits(model, batch), atol=1e-5, rtol=1e-4)


def test_without_mamba_ssm_mamba2_layers_scan_on_fla_simple_gla(kernels_on_cpu, monkeypatch):
    scans = []

    def gla(q, k, v, g, cu_seqlens, final_states):
        scans.append(cu_seqlens)
        return mamba2.scan_torch(q.float(), k.float(), v.float(), g, cu_seqlens, final_states)

    monkeypatch.setattr(mamba_ssm, "ssd_scan", lambda: None)
    monkeypatch.setattr(mamba2, "scan_kernel", gla)
    model = _build("bamba")
    batch, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_packed_logits(model, batch, labels), _separate_logits(model, batch),
                                   atol=1e-5, rtol=1e-4)
    assert scans and all(cu is batch["cu_seqlens"] for cu in scans)


def test_compiled_blocks_run_the_layers_outside_their_graphs():
    model = _build("qwen3_5_text")
    batch, labels = _batch()
    with torch.no_grad():
        eager = _packed_logits(model, batch, labels)
        for block in model.model.layers:
            block.compile(backend="eager")
        torch.testing.assert_close(_packed_logits(model, batch, labels), eager)


# --- a run: an HF-saved hybrid in, trained, exported, loaded back ------------------------------------------------


def test_an_hf_hybrid_starts_a_run_trains_and_its_export_loads_back_with_the_runs_logits(tmp_path, corpus):
    """Two runs from an HF-saved qwen3_5_text side by side: one with rows whole, whose first step computes the HF
    model's own loss (init_from_parity.py: transformers keeps no documents apart); one on packed documents, whose
    trained model's logits its export reproduces in transformers."""
    from flame.data.tokenizer import load_tokenizer

    hf, parity, dump = tmp_path / "hf", tmp_path / "parity", tmp_path / "run"
    parity_out, logits_file = tmp_path / "parity.json", tmp_path / "logits.pt"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs/tiny/qwen3_5_text.json"))).save_pretrained(hf)
    load_tokenizer(TOKENIZER).save_pretrained(hf)
    run = [f"--model.init_from={hf}", f"--training.dataset={corpus}", "--training.seq_len=64", "--training.batch_size=2",
           "--training.steps=2", "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1"]
    first, _ = two_at_a_time(
        lambda: check(torchrun([str(parity_out), *run, "--training.no-document_mask", f"--job.dump_folder={parity}"],
                               module=str(SCRIPTS / "init_from_parity.py"))),
        lambda: check(torchrun([*run, "--checkpoint.enable", "--checkpoint.interval=2", f"--job.dump_folder={dump}"],
                               module=str(SCRIPTS / "train_and_save_logits.py"), env={"FLAME_TEST_LOGITS": str(logits_file)})),
    )
    log = first.stdout + first.stderr
    assert "--model.init_from: loading the weights of" in log
    assert "Packed documents kept apart in 1 Qwen3_5GatedDeltaNet: once per document" in log
    assert metrics(parity)[1][LOSS] == pytest.approx(json.loads(parity_out.read_text())["hf_loss"], rel=1e-5)
    assert sorted(metrics(dump)) == [1, 2]
    convert("flame.utils.convert_dcp_to_hf", "--path", str(dump))
    exported = AutoModelForCausalLM.from_pretrained(dump / "hf").eval()
    # transformers picks fla's Triton kernels wherever fla is installed, a CPU too: there they run as their
    # PyTorch code, as they would without fla (what flame's builder applied in the run's process)
    layer = next(type(m) for m in exported.modules() if type(m).__name__ in hybrid.MIXERS)
    compat.transformers.reference_kernels_on_cpu(layer.__module__, tuple(hybrid.MIXERS[layer.__name__]))()
    expected = torch.load(logits_file)
    with torch.no_grad():
        torch.testing.assert_close(exported(expected["input_ids"]).logits, expected["logits"], rtol=0, atol=1e-5)


def test_a_kernel_transformers_no_longer_picks_at_import_is_refused(monkeypatch):
    module = "transformers.models.lfm2.modeling_lfm2"
    monkeypatch.setattr(importlib.import_module(module), "causal_conv1d_fn", lambda *args: None)
    with pytest.raises(ConfigError, match=f"has a {module}.causal_conv1d_fn that is not a kernel picked by "
                                          "use_kernel_func_from_hub_with_fallback"):
        compat.transformers.reference_kernels_on_cpu(module, ("causal_conv1d_fn",)).check()
