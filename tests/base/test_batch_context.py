"""The batch being computed (flame.base.batch_context): how its documents reach the attention."""

import pytest
import torch

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.kernels import attention


def _qkv(total: int, heads: int = 2, dim: int = 8):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(total, heads, dim, generator=generator) for _ in range(3)]


def test_attention_finds_the_batch_of_its_documents_and_nothing_outside_one():
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert batch_context.documents_of(cu_seqlens) is None  # no batch: callers use their own bound
    with batch_context.computing(BatchContext(cu_seqlens=cu_seqlens, max_seqlen=7)) as batch:
        assert batch_context.documents_of(cu_seqlens) is batch
        with pytest.raises(RuntimeError, match="bug in flame"):  # other documents inside this batch
            batch_context.documents_of(torch.tensor([0, 40], dtype=torch.int32))
    assert batch_context.current() is None


def test_a_pipeline_microbatch_nests_inside_its_step_and_keeps_the_step_count():
    step = BatchContext(global_valid_tokens=torch.tensor(40.0))
    with batch_context.computing(step):
        microbatch = step.replace(cu_seqlens=torch.tensor([0, 30, 40], dtype=torch.int32), max_seqlen=30)
        with batch_context.computing(microbatch):
            assert batch_context.current().max_seqlen == 30
            assert batch_context.current().global_valid_tokens is step.global_valid_tokens
        assert batch_context.current() is step  # the loss, computed after the stage's forward, sees the step


def test_document_attention_builds_a_batch_mask_once_and_computes_the_same_without_a_batch():
    attention.set_backend("sdpa")
    cu_seqlens = torch.tensor([0, 3, 10, 16], dtype=torch.int32)
    q, k, v = _qkv(16)
    alone = attention.document_attention(q, k, v, cu_seqlens, 16)
    batch = BatchContext(cu_seqlens=cu_seqlens, max_seqlen=7)
    with batch_context.computing(batch):
        first = attention.document_attention(q, k, v, cu_seqlens, 16, batch=batch)
        assert len(batch.masks) == 1
        second = attention.document_attention(q, k, v, cu_seqlens, 16, batch=batch)  # a later layer
        assert len(batch.masks) == 1
    torch.testing.assert_close(first, alone)
    torch.testing.assert_close(second, alone)
    # a token of the second document sees nothing of the first
    q2 = q.clone()
    q2[:3] = 0
    k2, v2 = k.clone(), v.clone()
    k2[:3], v2[:3] = 5.0, 5.0
    torch.testing.assert_close(attention.document_attention(q2, k2, v2, cu_seqlens, 16)[3:], alone[3:])


def test_the_chunk_total_comes_from_the_host_copy_only_for_the_batch_s_own_tensor():
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    step = BatchContext(cu_seqlens=cu_seqlens, cu_seqlens_host=[0, 5, 12])
    assert batch_context.host_chunk_total(cu_seqlens, 4) is None  # no batch
    with batch_context.computing(step):
        assert batch_context.host_chunk_total(cu_seqlens, 4) == 2 + 2  # 5 and 7 tokens, rounded up
        assert batch_context.host_chunk_total(cu_seqlens, 64) == 2
        assert batch_context.host_chunk_total(cu_seqlens.clone(), 4) is None  # same values, another tensor: read it
    # a microbatch's new documents drop the step's copy, which describes other documents
    microbatch = step.replace(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    assert microbatch.cu_seqlens_host is None
    assert step.replace(max_seqlen=7).cu_seqlens_host == [0, 5, 12]  # the same documents keep it


def test_the_trainer_s_batch_reaches_the_model_with_its_host_copy():
    from transformers import AutoModelForCausalLM

    from flame.models import load_model_config
    from flame.models.inputs import batch_inputs, to_device
    from tests.conftest import ROOT

    model = AutoModelForCausalLM.from_config(load_model_config(ROOT / "configs/tiny/gla.json"))
    loader_batch = {"input": torch.zeros(2, 6, dtype=torch.long), "position_ids": torch.zeros(2, 6, dtype=torch.long),
                    "cu_seqlens": torch.tensor([0, 4, 6, 12], dtype=torch.int32), "max_seqlen": 6}
    batch = to_device(loader_batch, torch.device("cpu"))
    assert batch["cu_seqlens_host"] == [0, 4, 6, 12]
    _, _, kwargs, context = batch_inputs(model, batch, torch.zeros(2, 6, dtype=torch.long), BatchContext())
    assert kwargs["cu_seqlens"] is context.cu_seqlens  # the tensor fla's kernels get is the context's
    assert context.cu_seqlens_host == [0, 4, 6, 12]
    with batch_context.computing(context):
        assert batch_context.host_chunk_total(kwargs["cu_seqlens"], 4) == 1 + 1 + 2
