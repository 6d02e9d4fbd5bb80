"""Context parallelism on CPU: exact document attention over the ranks' shards, parity with one process, refusals.

fla's context-parallel kernels (kda, gated_deltanet) and the varlen/flex backends need a GPU:
here only the layout they are given is checked; `python scripts/gpu_check.py --suite cp` runs them on GPUs.
"""

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from flame.launch import preflight
from flame.distributed.context_parallel import BatchLayout, rank_intervals
from flame.models.kernels import attention
from tests.conftest import ROOT, base_args, check, metrics, torchrun

CP2 = ["--parallelism.context_parallel_degree=2"]
# documents of a 48-token batch: every split below (2 or 3 ranks, head-tail or contiguous) cuts some of them
DOCUMENTS = [0, 5, 17, 18, 30, 41, 48]


def _qkv(total: int, device: str, dtype: torch.dtype, dim: int = 8):
    torch.manual_seed(0)
    heads, kv_heads = 4, 2  # grouped-query attention
    return [torch.randn(total, h, dim, device=device).to(dtype).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def _reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scale, window):
    """varlen_attn's semantics: per sequence, causal with the queries aligned to the last keys."""
    outputs = []
    for i in range(len(cu_q) - 1):
        q, k, v = query[cu_q[i] : cu_q[i + 1]], key[cu_k[i] : cu_k[i + 1]], value[cu_k[i] : cu_k[i + 1]]
        assert len(q) <= max_q and len(k) <= max_k
        query_pos = torch.arange(len(q))[:, None] + len(k) - len(q)
        key_pos = torch.arange(len(k))[None]
        mask = (key_pos <= query_pos) & ((query_pos - key_pos < window) if window else True)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def dense_reference(documents: list[int], window: int | None, device: str, dtype: torch.dtype, dim: int):
    """The whole batch's document attention (SDPA with a dense mask, fp32) of _qkv's inputs:
    the output and the gradients of query, key and value."""
    cu_seqlens = torch.tensor(documents, dtype=torch.int32, device=device)
    attention.set_backend("sdpa")
    inputs = [t.detach().float().requires_grad_() for t in _qkv(documents[-1], device, dtype, dim)]
    out = attention.document_attention(*inputs, cu_seqlens, documents[-1], window=window)
    return [out, *torch.autograd.grad(out.pow(2).sum(), inputs)]


def attention_of_local_queries(
    backend: str, size: int, balanced: bool, window: int | None, documents: list[int], device: str, dtype: torch.dtype, dim: int
):
    """Each rank's ``backend`` attention of its queries to the all-gathered keys, put back in the
    batch's order: the output and the gradients of query, key and value, in fp32. With size 1 and
    balanced False, the whole batch through the same backend."""
    total = documents[-1]
    cu_seqlens = torch.tensor(documents, dtype=torch.int32, device=device)
    query, key, value = _qkv(total, device, dtype, dim)
    layouts = [BatchLayout.build(cu_seqlens, total, size, rank, balanced) for rank in range(size)]
    # what the all-gather gives every rank: each rank's keys/values, in rank order
    gathered_key = torch.cat([key[layout.positions] for layout in layouts])
    gathered_value = torch.cat([value[layout.positions] for layout in layouts])
    out = torch.zeros(query.shape, device=device)
    for layout in layouts:
        local = layout.attend(query[layout.positions], gathered_key, gathered_value, backend, None, window)
        out = out.index_put((layout.positions,), local.float())
    grads = torch.autograd.grad(out.pow(2).sum(), (query, key, value))
    return [out, *(grad.float() for grad in grads)]


def check_against_whole_batch(
    backend: str, size: int, balanced: bool, window: int | None, documents: list[int] = DOCUMENTS,
    device: str = "cpu", dtype: torch.dtype = torch.float32, atol: float = 1e-5, rtol: float = 0.0, dim: int = 8,
) -> None:
    """attention_of_local_queries against dense_reference: outputs and input gradients."""
    expected = dense_reference(documents, window, device, dtype, dim)
    got = attention_of_local_queries(backend, size, balanced, window, documents, device, dtype, dim)
    for tensor, want in zip(got, expected):
        torch.testing.assert_close(tensor, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("size,balanced,window", list(itertools.product([2, 3], [True, False], [None, 4])))
def test_local_queries_attend_exactly_their_documents(size, balanced, window):
    check_against_whole_batch("sdpa", size, balanced, window)


@pytest.mark.parametrize("size,balanced,window", list(itertools.product([2, 3], [True, False], [None, 4])))
def test_varlen_gives_each_document_piece_its_document_prefix(monkeypatch, size, balanced, window):
    monkeypatch.setattr(attention, "_varlen", _reference_varlen)
    check_against_whole_batch("varlen", size, balanced, window)


def test_ranks_hold_every_token_once_and_head_tail_balances_causal_work():
    total, size = 96, 3
    for balanced in (True, False):
        held = sorted(p for r in range(size) for a, b in rank_intervals(total, size, r, balanced) for p in range(a, b))
        assert held == list(range(total))
    # one document over the whole batch: the keys a rank's queries see (its causal work)
    work = [sum(b * (b + 1) // 2 - a * (a + 1) // 2 for a, b in rank_intervals(total, size, r, True)) for r in range(size)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("balanced", [True, False])
def test_local_documents_are_the_pieces_fla_kernels_expect(balanced):
    from fla.ops.cp.context import get_cp_cu_seqlens

    cu_seqlens = torch.tensor([0, 3, 28, 32, 42, 57, 64, 84, 96], dtype=torch.int32)
    for rank in range(2):
        ours = BatchLayout.build(cu_seqlens, 96, 2, rank, balanced)
        fla = get_cp_cu_seqlens(cu_seqlens, world_size=2, rank=rank, layout="zigzag" if balanced else "contiguous")
        assert ours.cu_seqlens.tolist() == fla.cu_seqlens.tolist()


def test_models_match_the_whole_batch_under_context_parallel():
    # llama both layouts, mistral with a sliding window, qwen2/3, the custom example, fla's transformer
    tiny = ROOT / "configs" / "tiny"
    specs = [f"{tiny / 'llama.json'}", f"{tiny / 'llama.json'}:contiguous", f"{tiny / 'mistral.json'}",
             f"{tiny / 'qwen2.json'}", f"{tiny / 'qwen3.json'}", str(ROOT / "custom_models" / "example_lm" / "config_tiny.json"),
             f"{tiny / 'transformer.json'}", f"{tiny / 'transformer.json'}:contiguous"]
    result = check(torchrun(specs, nproc=2, module=str(ROOT / "tests" / "scripts" / "cp_parity.py")))
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("parity ")]
    assert [line[1] for line in lines] == specs
    for _, spec, loss_err, grad_err in lines:
        assert float(loss_err) < 1e-5 and float(grad_err) < 1e-5, (spec, loss_err, grad_err)


@pytest.fixture(scope="module")
def one_process(single_process_run):
    return metrics(single_process_run)


def _assert_same_curve(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step, row in expected.items():
        loss, norm = got[step]["loss_metrics/global_avg_loss"], got[step]["grad_norm"]
        assert math.isclose(loss, row["loss_metrics/global_avg_loss"], rel_tol=1e-5), (step, loss, row)
        assert math.isclose(norm, row["grad_norm"], rel_tol=1e-4), (step, norm, row)


def test_two_rank_context_parallel_trains_like_one_process(tmp_path, tiny_model, corpus, one_process):
    dump = tmp_path / "cp2"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=4) + CP2 + ["--checkpoint.no-enable"], nproc=2))
    log = result.stdout + result.stderr
    assert "Context parallel over 2 ranks (headtail layout)" in log and "Applied FSDP2 over 2 ranks (fsdp 2)" in log
    _assert_same_curve(metrics(dump), one_process)


def test_context_parallel_with_fsdp_compile_and_checkpointing_trains_like_one_process(tmp_path, tiny_model, corpus, one_process):
    # 2 data-parallel ranks of one row each hold the same global batch as 1 process of 2 rows
    dump = tmp_path / "cp2_fsdp2"
    flags = CP2 + ["--parallelism.context_parallel_load_balancer=None", "--training.batch_size=1", "--checkpoint.no-enable",
                   "--training.compile", "--compile.backend=aot_eager", "--activation_checkpoint.mode=full"]
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=4) + flags, nproc=4))
    log = result.stdout + result.stderr
    assert "Context parallel over 2 ranks (contiguous layout)" in log and "Applied FSDP2 over 4 ranks (fsdp 4)" in log
    _assert_same_curve(metrics(dump), one_process)


def _preflight_error(tmp_path, capsys, model_config: dict | str, *flags: str, world_size: int = 2) -> str:
    path = model_config
    if isinstance(model_config, dict):
        path = tmp_path / "model.json"
        path.write_text(json.dumps(model_config))
    args = [f"--model.config={path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", "--training.seq_len=64", "--training.batch_size=1", *flags]
    code = preflight.main(["--world-size", str(world_size), "--", *args])
    error = capsys.readouterr().err.strip()
    assert code == 2, error
    return error


def test_model_types_without_context_parallel_are_refused(tmp_path, capsys):
    error = _preflight_error(tmp_path, capsys, str(ROOT / "configs" / "tiny" / "gla.json"), *CP2)
    assert error.startswith("flame: error: --parallelism.context_parallel_degree 2: gla cannot run context parallel")
    assert "types that can: flame_example_lm, gated_deltanet, kda, llama, mistral, qwen2, qwen3, transformer" in error
    assert error.endswith("Use data parallelism for it (--parallelism.context_parallel_degree 1)")
    if not torch.cuda.is_available():
        error = _preflight_error(tmp_path, capsys, str(ROOT / "configs" / "tiny" / "kda.json"), *CP2)
        assert error.endswith("fla's kda runs context parallel with fla's CP kernels, which need NVIDIA GPUs")


def test_layouts_context_parallel_cannot_take_are_refused(tmp_path, capsys, tiny_model):
    error = _preflight_error(tmp_path, capsys, tiny_model, *CP2, "--training.seq_len=30")
    assert "a batch's 30 tokens (--training.batch_size x --training.seq_len) are not divisible by 2 x cp = 4" in error
    error = _preflight_error(tmp_path, capsys, tiny_model, *CP2, "--parallelism.context_parallel_load_balancer=ptrr")
    assert "flame balances context-parallel work with 'headtail' (the default) or not at all (None)" in error
    error = _preflight_error(tmp_path, capsys, tiny_model, *CP2, "--parallelism.context_parallel_rotate_method=alltoall")
    assert "all-gathers K/V ('allgather', the default); leave it unset" in error
    error = _preflight_error(tmp_path, capsys, tiny_model, *CP2, "--parallelism.pipeline_parallel_degree=2", world_size=4)
    assert "flame cannot combine context and pipeline parallelism; use one of them" in error
    error = _preflight_error(tmp_path, capsys, tiny_model, *CP2, "--parallelism.tensor_parallel_degree=2",
                             "--parallelism.context_parallel_load_balancer=None", "--training.seq_len=34", world_size=4)
    assert "each rank's 17 tokens are not divisible by --parallelism.tensor_parallel_degree 2" in error
