"""Document-masked causal softmax attention from PyTorch itself (no flash-attn).

Packed rows hold several documents; a token must attend only to earlier tokens of its own
document. Documents are described as in flash-attn: ``cu_seqlens`` (int32, ``[N + 1]``, the
start offset of each document in the flattened batch, last entry = total tokens).

Backends (``--model.attention``):
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA; torch's FlashAttention kernel);
- ``flex``: FlexAttention with a document block mask (CUDA);
- ``sdpa``: the reference path: SDPA with a dense block-diagonal causal mask (any device;
  memory grows with tokens², so it is meant for CPU debugging and for tests);
- ``auto``: ``varlen`` on CUDA (measured faster than ``flex``; docs/perf-log-archive.md), ``sdpa`` on CPU.

The attention is plugged into
- HF models, as the attention implementation ``flame`` of transformers' registry
  (``hf_document_attention``; flame.compat.transformers registers it); flame passes
  ``cu_seq_lens_q`` with the batch, which reaches the attention function as a keyword;
- fla's softmax-attention layers (``transformer``, ``samba``, hybrids), which call
  flash-attn's ``flash_attn_func``/``flash_attn_varlen_func``: flame provides both (and, for
  fla's ``moba``, flash-attn's internal varlen forward/backward: flame.models.kernels.flash_attn_internals);
  flame.compat.fla puts them where fla looks for flash-attn's. Outside a training batch
  (``generate``, scoring an export: no ``flame.base.batch_context`` active) they run SDPA on rows
  or on each segment, with flash-attn's alignment of queries after cached keys, in any dtype.

Kernels need the longest document as a Python int, and the dense/flex masks are best built
once per batch: both come from the batch being computed (flame.base.batch_context), so that
no layer has to synchronize with the GPU to find them. Under context parallelism that batch
also holds the CP layout: the layers then attend their rank's queries to every key of their
documents (flame.distributed.context_parallel). Outside an active batch (``generate``) the
bound the caller gives is used and masks are built per call.
The attention call runs outside torch.compile graphs (a graph break per layer), so the
per-batch lengths never cause recompilation.
"""

import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.attention.varlen import varlen_attn

from flame.base.batch_context import BatchContext, documents_of
from flame.base.batch_context import current as current_batch
from flame.models.kernels.meta_keeps import Keeps

BACKENDS = ("auto", "varlen", "flex", "sdpa")
HF_ATTENTION = "flame"

_backend = "auto"  # the job's --model.attention, set once at startup (set_backend)
# torch 2.11's varlen_attn has no grouped-query option; later versions do
_VARLEN_HAS_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _backend = name


def resolve_backend(device: torch.device) -> str:
    return backend_for(_backend, cuda=device.type == "cuda")


def backend_for(setting: str, cuda: bool) -> str:
    """The backend --model.attention ``setting`` runs: auto is varlen on CUDA, sdpa elsewhere."""
    return setting if setting != "auto" else ("varlen" if cuda else "sdpa")


def _batch_mask(kind: str, batch: BatchContext | None, total: int, window: int | None, rows: int, build):
    """A mask of the batch's documents, built by the first layer that asks for it (per call outside a batch)."""
    if batch is None:
        return build()
    key = (kind, total, window, rows)
    if key not in batch.masks:
        batch.masks[key] = build()
    return batch.masks[key]


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The index of the document each of the ``total`` tokens belongs to."""
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True)


@torch.compiler.disable
def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
    rows: int = 1,
    batch: BatchContext | None = None,
) -> torch.Tensor:
    """Causal attention within each document: ``[T, Hq, D]`` queries, ``[T, Hkv, D]`` keys/values.

    ``window``: a query sees at most this many keys (itself included); None = the whole document.
    ``max_seqlen`` may be an upper bound; ``batch``, the batch these documents are of (if they
    are), gives the exact value, caches the masks and carries the context-parallel layout.
    ``rows``: the tokens are that many equal rows no document crosses (the dense reference
    path then masks each row, not the whole batch).
    """
    backend = resolve_backend(query.device)
    if backend != "sdpa" and query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        # e.g. HF rotary embeddings promote q/k to fp32 under autocast; SDPA would compute in
        # the autocast dtype, and the flash kernel only takes fp16/bf16
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if backend == "varlen" and query.dtype == torch.float32:
        backend = "flex"  # fp32 training without autocast: the flash kernel has no fp32
    if batch is not None and batch.context_parallel is not None:  # this rank's queries, all ranks' keys
        return batch.context_parallel.attention(query, key, value, backend, scale, window)
    if backend == "varlen":
        max_seqlen = batch.max_seqlen if batch is not None else max_seqlen
        return _varlen(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale, window)
    if backend == "flex":
        return _flex(query, key, value, cu_seqlens, scale, window, batch)
    return _sdpa(query, key, value, cu_seqlens, scale, window, rows, batch)


def _allowed(query_pos, key_pos, documents, window):
    allowed = (documents[query_pos] == documents[key_pos]) & (query_pos >= key_pos)
    if window is not None:
        allowed = allowed & (query_pos - key_pos < window)
    return allowed


def _dense_mask(cu_seqlens, total, window, rows):
    length = total // rows
    documents = document_ids(cu_seqlens, total).view(rows, length)
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.stack([_allowed(positions[:, None], positions[None, :], row, window) for row in documents])


def _sdpa(query, key, value, cu_seqlens, scale, window, rows, batch):
    total, length = query.shape[0], query.shape[0] // rows
    mask = _batch_mask("dense", batch, total, window, rows, lambda: _dense_mask(cu_seqlens, total, window, rows))
    q, k, v = (t.view(rows, length, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[1], value.shape[-1])


def _varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window):
    # window (-1, 0) = causal; (w - 1, 0) = causal within w keys. Where a sequence has fewer
    # queries than keys, the queries are its last tokens (flash-attn's bottom-right alignment).
    options = {"scale": scale, "window_size": (-1 if window is None else window - 1, 0)}
    key, value, grouped = _varlen_keys(query, key, value)
    if grouped:
        options["enable_gqa"] = True
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    width = value.shape[-1]
    if width < query.shape[-1]:  # the flash kernel takes one head size: narrower values (latent attention) padded
        value = F.pad(value, (0, query.shape[-1] - width))
    out = varlen_attn(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
    return out[..., :width]


def _varlen_keys(query, key, value):
    """Keys and values as torch's varlen kernel takes them, and whether it groups the queries itself (enable_gqa):
    without that option, each key/value head repeated for its group of query heads."""
    if key.shape[1] == query.shape[1]:
        return key, value, False
    if _VARLEN_HAS_GQA:
        return key, value, True
    groups = query.shape[1] // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), False


_compiled_flex_attention = None


def _flex(query, key, value, cu_seqlens, scale, window, batch):
    total = query.shape[0]

    def build():
        documents = document_ids(cu_seqlens, total)
        return create_block_mask(
            lambda b, h, q, k: _allowed(q, k, documents, window), None, None, total, total, device=query.device
        )

    return _flex_attention(query, key, value, _batch_mask("flex", batch, total, window, 1, build), scale)


def _flex_attention(query, key, value, block_mask, scale):
    """FlexAttention of ``[Tq, Hq, D]`` queries and ``[Tk, Hkv, D]`` keys/values under ``block_mask``."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    out = _compiled_flex_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        block_mask=block_mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1],
    )
    return out[0].transpose(0, 1)


# transformers: the "flame" attention implementation

_keeping_as: str | None = None  # kept_as_flash_kernels' backend: a meta forward keeps what that kernel keeps


@contextmanager
def kept_as_flash_kernels(backend: str):
    """Inside, the "flame" attention on meta tensors keeps for its backward what ``backend`` (``varlen`` or
    ``flex``) keeps: the flattened queries, keys and values (queries and keys copied out of HF's layout, values
    a view; varlen without grouped-query support takes each key and value head repeated), the output and a
    float32 logsumexp per head and token.

    flame.memory measures an HF model's activations by a meta forward's saved tensors; meta tensors take
    PyTorch's math attention, which keeps float32 copies of the queries, the transposed keys and the values
    (and the T x T weights): 12,288 bytes a token for a llama 340M block, where varlen keeps 6,208.
    """
    global _keeping_as
    if backend not in ("varlen", "flex"):
        raise ValueError(f"kept_as_flash_kernels: {backend!r} is not a flash-style backend (varlen, flex)")
    before, _keeping_as = _keeping_as, backend
    try:
        yield
    finally:
        _keeping_as = before


def _flattened(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
    """``[B, H, L, D]`` -> ``[B * L, H, D]``: the kernels' token-major layout (a copy unless already laid out so).
    Each keeps its own head size: multi-head latent attention's values are narrower than its queries and keys."""
    rows, _, length, _ = query.shape
    return [t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[-1]) for t in (query, key, value)]


def hf_document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``[B, H, L, D]`` in, ``[B, L, H, D]`` out.

    With ``cu_seq_lens_q`` (flame's training batches) documents are masked over the
    flattened batch; without it (e.g. ``generate``) this is plain causal SDPA.
    """
    if dropout > 0:
        raise ValueError("flame's document attention has no attention dropout; set attention_dropout to 0")
    rows, heads, length, _ = query.shape
    width = value.shape[-1]  # the output's head size
    if _keeping_as is not None and query.device.type == "meta":
        query, key, value = _flattened(query, key, value)
        if _keeping_as == "varlen":
            key, value, _ = _varlen_keys(query, key, value)
        logsumexp = query.new_empty((heads, query.shape[0]), dtype=torch.float32)
        # the output is kept too, as the o_proj's input (one storage): counted there
        out = Keeps.apply(query.new_empty(query.shape[0], heads, width), query, key, value, logsumexp)
        return out.view(rows, length, heads, width), None
    if cu_seq_lens_q is None:
        if attention_mask is not None or key.shape[2] != length and length > 1:
            raise ValueError("the 'flame' attention handles unpadded batches; load the model with attn_implementation='sdpa'")
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=length > 1, scale=scaling, enable_gqa=key.shape[1] != heads
        )
        return out.transpose(1, 2), None
    out = document_attention(*_flattened(query, key, value), cu_seq_lens_q, length, scale=scaling,
                             window=sliding_window, rows=rows, batch=documents_of(cu_seq_lens_q))
    return out.view(rows, length, heads, width), None


# fla: flash-attn's two entry points, as fla's attention layers call them


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **unsupported,
):
    _check_flash_call(causal, dropout_p, window_size, unsupported)
    window = None if window_size[0] < 0 else window_size[0] + 1
    if current_batch() is None:  # inference: padded batches, and queries after cached keys (generate)
        same = cu_seqlens_q is cu_seqlens_k or q.shape[0] == k.shape[0] and torch.equal(cu_seqlens_q, cu_seqlens_k)
        if not (same and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
            return segment_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window)
    # training: self-attention, cu_seqlens_k describes the same documents
    batch = documents_of(cu_seqlens_q)
    return document_attention(q, k, v, cu_seqlens_q, max_seqlen_q, scale=softmax_scale, window=window, batch=batch)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **unsupported):
    _check_flash_call(causal, dropout_p, window_size, unsupported)
    if current_batch() is None:  # inference: SDPA's own kernels, any dtype and device, keys cached or not
        window = None if window_size[0] < 0 else window_size[0] + 1
        return aligned_attention(q, k, v, softmax_scale, window)
    rows, length = q.shape[:2]
    cu_seqlens = torch.arange(0, (rows + 1) * length, length, device=q.device, dtype=torch.int32)
    flat = [t.reshape(rows * length, *t.shape[2:]) for t in (q, k, v)]
    window = None if window_size[0] < 0 else window_size[0] + 1
    # equal rows, not the batch's documents (fla's types that take rows whole)
    out = document_attention(*flat, cu_seqlens, length, scale=softmax_scale, window=window, rows=rows)
    return out.view(rows, length, *out.shape[1:])


def aligned_attention(query, key, value, scale=None, window=None):
    """Causal attention of ``[B, Lq, Hq, D]`` queries, the last Lq positions of ``[B, Lk, Hkv, D]`` keys/values.

    flash-attn's alignment: with a cache, generation's new queries come after every cached key.
    """
    length_q, length_k = query.shape[1], key.shape[1]
    mask = None
    if length_q != length_k or window is not None:
        positions_q = torch.arange(length_k - length_q, length_k, device=query.device)[:, None]
        positions_k = torch.arange(length_k, device=query.device)[None, :]
        mask = positions_k <= positions_q
        if window is not None:
            mask = mask & (positions_q - positions_k < window)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=key.shape[2] != query.shape[2],
    )
    return out.transpose(1, 2)


def segment_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, scale=None, window=None):
    """``aligned_attention`` within each segment: ``[Tq, Hq, D]`` queries, ``[Tk, Hkv, D]`` keys/values.

    For inference (one SDPA call per segment, the segment bounds read on the host): a padded
    batch unpadded, or, in generation, each sequence's new queries after its cached keys.
    """
    out = query.new_zeros(*query.shape[:2], value.shape[-1])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if q1 > q0:
            out[q0:q1] = aligned_attention(query[None, q0:q1], key[None, k0:k1], value[None, k0:k1], scale, window)[0]
    return out


def _check_flash_call(causal, dropout_p, window_size, unsupported):
    if not causal or dropout_p or window_size[1] > 0 or any(v not in (None, False) for v in unsupported.values()):
        raise ValueError(
            "flame's attention (in place of flash-attn) supports causal attention without dropout, "
            f"softcap or alibi; got causal={causal}, dropout_p={dropout_p}, window_size={window_size}, {unsupported}"
        )
