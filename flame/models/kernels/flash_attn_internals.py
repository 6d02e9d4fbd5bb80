"""flash-attn's internal varlen forward and backward, as fla's MoBA calls them, from PyTorch itself.

fla's moba (``fla.ops.moba.parallel``) merges two attentions of each query by their log-sum-exps:
causal attention within the query's own chunk, and attention to the earlier chunks its gate
selects. It calls flash-attn's ``_flash_attn_varlen_forward`` for each output and its log-sum-exp,
and ``_flash_attn_varlen_backward`` with the *merged* output and log-sum-exp, which is all the
attention gradient needs (with D = rowsum(dout * out), dS = P * (dP - D)). flame gives both under
the same signatures (``varlen_forward``, ``varlen_backward``; flame.compat.fla puts them
where fla looks for flash-attn's):
- CUDA in bf16/fp16: PyTorch's own FlashAttention-2 kernels (``aten._flash_attention_forward``
  and ``_backward``, which torch's ``varlen_attn`` runs);
- otherwise (CPU, float32): a reference in plain PyTorch on the segments padded into a batch;
  its memory grows with segments x longest query segment x longest key segment.

Segments are given as in flash-attn: ``cu_seqlens_q``/``cu_seqlens_k`` over ``[total, heads, dim]``
tensors; with ``causal``, a segment's queries are aligned to its last keys. Log-sum-exps are
float32 ``[heads, total queries]``, natural logs of the scaled scores, as flash-attn's.
"""

import torch


def _uses_torch_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
    if dropout_p or window_size_left != -1 or window_size_right != -1 or softcap or alibi_slopes is not None:
        raise ValueError(
            "flame's varlen attention (in place of flash-attn's) supports no dropout, window, softcap or alibi; "
            f"got dropout_p={dropout_p}, window_size=({window_size_left}, {window_size_right}), softcap={softcap}, "
            f"alibi_slopes={alibi_slopes is not None}"
        )


def varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, **unused,
):
    """(output, log-sum-exp, None, None): flash-attn's four results; the last two (for dropout) are unused."""
    _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if _uses_torch_flash(q):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q.int(), cu_seqlens_k.int(), max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=scale
        )
        return out, lse, None, None
    segments = _Segments(q, k, cu_seqlens_q, cu_seqlens_k, causal)
    scores, lse = segments.scores_and_lse(q, k, scale)
    probs = (scores - lse[..., None]).exp().nan_to_num(0.0)  # a query without keys: all -inf, output 0
    out = torch.einsum("nhqk,nkhd->nqhd", probs, segments.expand_heads(segments.keys(v)))
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # as flash-attn gives such a query
    return segments.queries_back(out).to(q.dtype), segments.lse_back(lse).float(), None, None


def varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
    alibi_slopes=None, deterministic=False, rng_state=None, **unused,
):
    """Write the gradients of q, k, v into ``dq``, ``dk``, ``dv`` from ``out`` and ``softmax_lse`` as given."""
    _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if _uses_torch_flash(q):
        no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout's RNG state: unread at p = 0
        grads = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, softmax_lse.contiguous(), cu_seqlens_q.int(), cu_seqlens_k.int(),
            max_seqlen_q, max_seqlen_k, 0.0, causal, no_dropout, no_dropout, scale=scale,
        )
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)
        return
    segments = _Segments(q, k, cu_seqlens_q, cu_seqlens_k, causal)
    scores, _ = segments.scores_and_lse(q, k, scale)
    lse = segments.queries(softmax_lse.t()[..., None]).squeeze(-1).transpose(1, 2).to(scores.dtype)  # [N, H, Lq]
    probs = (scores - lse[..., None]).exp().nan_to_num(0.0)  # masked scores are -inf: 0
    dout_, out_ = segments.queries(dout), segments.queries(out)
    keys, values, queries = segments.keys(k), segments.keys(v), segments.queries(q)
    dprobs = torch.einsum("nqhd,nkhd->nhqk", dout_, segments.expand_heads(values))
    dscores = probs * (dprobs - (dout_ * out_).sum(-1).transpose(1, 2)[..., None])
    dq.copy_(segments.queries_back(torch.einsum("nhqk,nkhd->nqhd", dscores, segments.expand_heads(keys)) * scale))
    dk.copy_(segments.keys_back(segments.sum_groups(torch.einsum("nhqk,nqhd->nkhd", dscores, queries) * scale)))
    dv.copy_(segments.keys_back(segments.sum_groups(torch.einsum("nhqk,nqhd->nkhd", probs, dout_))))


class _Segments:
    """The reference path's layout: every segment's queries and keys padded into a batch ``[N, L, H, D]``."""

    def __init__(self, q, k, cu_seqlens_q, cu_seqlens_k, causal):
        self.total_q, self.total_k = q.shape[0], k.shape[0]
        self.groups = q.shape[1] // k.shape[1]  # grouped-query attention: query heads per key head
        self.q_index, self.q_valid = self._layout(cu_seqlens_q.long())
        self.k_index, self.k_valid = self._layout(cu_seqlens_k.long())
        allowed = self.q_valid[:, :, None] & self.k_valid[:, None, :]  # [N, Lq, Lk]
        if causal:  # queries aligned to the segment's last keys
            q_pos = torch.arange(self.q_valid.shape[1], device=q.device)[None, :, None]
            k_pos = torch.arange(self.k_valid.shape[1], device=q.device)[None, None, :]
            offset = (self.k_valid.sum(1) - self.q_valid.sum(1))[:, None, None]
            allowed &= k_pos <= q_pos + offset
        self.allowed = allowed[:, None]  # [N, 1, Lq, Lk]

    @staticmethod
    def _layout(cu_seqlens):
        lengths = cu_seqlens.diff()
        positions = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=cu_seqlens.device)
        valid = positions[None, :] < lengths[:, None]
        index = (cu_seqlens[:-1, None] + positions[None, :]).clamp(max=max(int(cu_seqlens[-1]) - 1, 0))
        return index, valid

    def queries(self, x):  # computed in float32 or wider
        return x[self.q_index].to(torch.promote_types(x.dtype, torch.float32))

    def keys(self, x):
        return x[self.k_index].to(torch.promote_types(x.dtype, torch.float32))

    def expand_heads(self, x):
        return x.repeat_interleave(self.groups, dim=2) if self.groups > 1 else x

    def sum_groups(self, x):
        return x.unflatten(2, (-1, self.groups)).sum(3) if self.groups > 1 else x

    def scores_and_lse(self, q, k, scale):
        scores = torch.einsum("nqhd,nkhd->nhqk", self.queries(q), self.expand_heads(self.keys(k))) * scale
        scores = scores.masked_fill(~self.allowed, float("-inf"))
        return scores, scores.logsumexp(-1)  # [N, H, Lq, Lk], [N, H, Lq]

    def queries_back(self, x):  # [N, Lq, ...] -> [total_q, ...]
        flat = x.new_zeros(self.total_q, *x.shape[2:])
        return flat.index_put_((self.q_index[self.q_valid],), x[self.q_valid])

    def keys_back(self, x):
        flat = x.new_zeros(self.total_k, *x.shape[2:])
        return flat.index_put_((self.k_index[self.k_valid],), x[self.k_valid])

    def lse_back(self, lse):  # [N, H, Lq] -> [H, total_q]
        return self.queries_back(lse.transpose(1, 2)).t().contiguous()
