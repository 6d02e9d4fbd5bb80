"""Pick flame's CUDA attention backend and check the fused loss, by measurement.

    python scripts/bench/attention_and_loss.py          # on a GPU

1. Document attention at 340M shapes (16 heads x 64, bf16) on real packed documents of a
   65536-token row: each backend's agreement with per-document SDPA, and its forward +
   backward time; varlen also with the row length as max_seqlen (what fla passes).
2. Loss at 65536 tokens x 32000 vocab (hidden 1024): logits + CE, fla's fused linear CE and
   flame's chunked linear CE:
   time and peak memory of forward + backward.
"""

import time

import torch
import torch.nn.functional as F
from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

from flame.components.loss import linear_cross_entropy_sum
from flame.models import attention
from scripts.bench.packed_data import packed_batches


def timed(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def per_document_reference(q, k, v, cu_seqlens):
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)[0].transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs)


def attention_bench(tokens=65536, heads=16, head_dim=64):
    _, _, cu_seqlens, max_seqlen = packed_batches(tokens, 1)[0]
    lengths = cu_seqlens.diff()
    print(f"documents: {len(lengths)} in {tokens} tokens, mean {lengths.float().mean():.0f}, max {max_seqlen}")
    q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    reference = per_document_reference(q, k, v, cu_seqlens)
    grad = torch.randn_like(reference)
    for backend, bound in (("varlen", max_seqlen), ("varlen", tokens), ("flex", max_seqlen)):
        attention.set_backend(backend)
        attention.use_batch_documents(cu_seqlens, bound)
        try:
            out = attention.document_attention(q, k, v, cu_seqlens, bound)
            error = (out.float() - reference.float()).abs().max().item()
            ms = timed(lambda: attention.document_attention(q, k, v, cu_seqlens, bound).backward(grad))
            print(f"attention {backend:6s} max_seqlen={bound:6d}: max|out - per-doc SDPA| = {error:.4f}, fwd+bwd {ms:.2f} ms")
        except Exception as error:  # report and go on: this is a measurement
            print(f"attention {backend}: FAILED {type(error).__name__}: {error}")
    attention.set_backend("auto")


def loss_bench(tokens=65536, hidden=1024, vocab=32000):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")

    def plain():
        F.cross_entropy(F.linear(x, w).float(), y, reduction="sum").backward()

    def fla_fused():
        fused_linear_cross_entropy_loss(x, y, w, reduction="sum").backward()

    def flame_chunked():
        linear_cross_entropy_sum(x, w, None, y).backward()

    for name, fn in (("logits + CE", plain), ("fla fused linear CE", fla_fused), ("flame chunked CE", flame_chunked)):
        fn()
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(fn, 5)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        x.grad = w.grad = None
        print(f"loss {name:16s}: fwd+bwd {ms:.1f} ms, peak extra memory {peak:.2f} GiB")
    plain_loss = F.cross_entropy(F.linear(x, w).float(), y, reduction="sum")
    chunked_loss = linear_cross_entropy_sum(x, w, None, y)
    print(f"loss values: logits+CE {plain_loss.item():.2f} flame chunked {chunked_loss.item():.2f}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--loss"]:
        loss_bench()
        sys.exit()
    print("varlen_attn signature:", __import__("inspect").signature(__import__("torch.nn.attention.varlen", fromlist=["x"]).varlen_attn))
    attention_bench()
    loss_bench()
