"""fla's MoBA attention on flame's varlen forward/backward (flame.models.kernels.flash_attn_internals), on CPU.

fla's real ``parallel_moba`` runs here: its gate, chunking and log-sum-exp merge are PyTorch, and
flame's reference path stands in for flash-attn's internal kernels (tests/gpu/test_moba_kernels.py
holds torch's FlashAttention path to this reference on a GPU).
"""

import pytest
import torch

from flame.models.kernels import attention, flash_attn_internals

from flame.models import registry

DOCUMENTS = torch.tensor([0, 130, 300], dtype=torch.int32)  # two documents, several 32-token chunks each
HEADS, DIM, CHUNK = 2, 16, 32


@pytest.fixture(scope="module")
def parallel_moba():
    registry.import_fla()  # installs flame's varlen forward/backward where flash-attn is missing
    from fla.ops.moba import parallel

    assert parallel._flash_attn_varlen_forward is flash_attn_internals.varlen_forward
    return parallel.parallel_moba


def _inputs(seed=0, total=300, heads=HEADS, kv_heads=HEADS):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(total, heads, DIM), (total, kv_heads, DIM), (total, kv_heads, DIM)]
    return [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]


def _outputs_and_grads(output, inputs, seed=1):
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return [output.detach(), *torch.autograd.grad((output * weights).sum(), inputs)]


def _assert_close(got, expected, tol=1e-5):
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, expected):
        assert (a - b).abs().max() <= tol * b.abs().max(), name


def _masked_attention(q, k, v, allowed):
    """Dense reference: ``allowed[h, t, s]`` says whether query t of head h sees key s."""
    scores = torch.einsum("thd,shd->hts", q, k) * DIM**-0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def test_moba_choosing_every_earlier_chunk_is_causal_document_attention(parallel_moba):
    # topk above the chunk count: every query sees its whole document so far, as plain attention
    q, k, v = _inputs()
    moba = parallel_moba(q[None], k[None], v[None], DOCUMENTS, max_seqlen=170, chunk_size=CHUNK, topk=100)[0]
    attention.set_backend("sdpa")
    plain = attention.document_attention(q, k, v, DOCUMENTS, 170)
    _assert_close(_outputs_and_grads(moba, (q, k, v)), _outputs_and_grads(plain, (q, k, v)))


def test_moba_sees_its_own_chunk_and_the_gates_top_chunks(parallel_moba):
    # topk 2: each (token, head) sees its own chunk causally and the one earlier chunk of its
    # document whose mean key scores highest with its query (not a document's last chunk)
    q, k, v = _inputs(seed=2)
    moba = parallel_moba(q[None], k[None], v[None], DOCUMENTS, max_seqlen=170, chunk_size=CHUNK, topk=2)[0]

    total = q.shape[0]
    starts = [s for a, b in zip(DOCUMENTS[:-1].tolist(), DOCUMENTS[1:].tolist()) for s in range(a, b, CHUNK)]
    ends = [min(s + CHUNK, next(int(e) for e in DOCUMENTS[1:] if e > s)) for s in starts]
    targets = [(s, e) for s, e in zip(starts, ends) if e not in DOCUMENTS.tolist()]  # a document's last chunk is none
    chunk_of = torch.tensor([next(i for i, (s, e) in enumerate(zip(starts, ends)) if s <= t < e) for t in range(total)])
    allowed = (chunk_of[:, None] == chunk_of[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    allowed = allowed[None].repeat(HEADS, 1, 1)
    document_of = torch.bucketize(torch.arange(total), DOCUMENTS[1:], right=True)
    with torch.no_grad():
        for h in range(HEADS):
            for t in range(total):
                eligible = [(s, e) for s, e in targets if e <= t and document_of[s] == document_of[t]]
                if eligible:
                    best = max(eligible, key=lambda c: float(q[t, h] @ k[c[0]:c[1], h].mean(0)))
                    allowed[h, t, best[0]:best[1]] = True
    assert allowed.sum() > torch.ones(total, total).tril().sum() * HEADS / 4  # the gate did choose chunks

    reference = _masked_attention(q, k, v, allowed)
    _assert_close(_outputs_and_grads(moba, (q, k, v)), _outputs_and_grads(reference, (q, k, v)))


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_forward_and_backward_are_attention_and_its_gradient(causal):
    # segments with more keys than queries (causal: queries aligned to the last keys), grouped-query heads
    cu_q, cu_k = torch.tensor([0, 3, 10, 10, 17], dtype=torch.int32), torch.tensor([0, 8, 15, 19, 30])
    q, k, v = _inputs(seed=3, total=17, heads=4, kv_heads=2)
    k, v = (torch.randn(30, 2, DIM, requires_grad=True) for _ in range(2))
    out, lse, *_ = flash_attn_internals.varlen_forward(q, k, v, cu_q, cu_k, 7, 11, softmax_scale=0.3, causal=causal)

    allowed = torch.zeros(4, 17, 30, dtype=torch.bool)
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        for t in range(a, b):
            last = d if not causal else c + (d - c) - (b - t) + 1
            allowed[:, t, c:last] = True
    expanded = [x.repeat_interleave(2, dim=1) for x in (k, v)]
    scores = torch.einsum("thd,shd->hts", q, expanded[0]) * 0.3
    reference = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), expanded[1])
    assert torch.allclose(out, reference, atol=1e-6) and out.dtype == q.dtype
    assert torch.allclose(lse, scores.masked_fill(~allowed, float("-inf")).logsumexp(-1).float())
    assert lse.dtype == torch.float32 and lse.shape == (4, 17)

    dout = torch.randn_like(out)
    expected = torch.autograd.grad((reference * dout).sum(), (q, k, v))
    grads = [torch.empty_like(x) for x in (q, k, v)]
    flash_attn_internals.varlen_backward(dout, q, k, v, out, lse, *grads, cu_q, cu_k, 7, 11, softmax_scale=0.3, causal=causal)
    for name, got, want in zip("qkv", grads, expected):
        assert torch.allclose(got, want, atol=1e-5), (name, (got - want).abs().max())


def test_varlen_calls_flash_attn_options_it_cannot_honour_refused():
    q, k, v = _inputs(total=8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="no dropout, window, softcap or alibi"):
        flash_attn_internals.varlen_forward(q, k, v, cu, cu, 8, 8, dropout_p=0.1)
