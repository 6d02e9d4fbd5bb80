"""fla's Mamba2 layer trained through Triton kernels, its packed documents kept apart.

Written for fla-core 0.6.0 and mamba-ssm 2.3.2.post1. Upstream, fla's ``Mamba2`` layer trains
through mamba_ssm's fused kernel where mamba_ssm is installed (which also needs causal_conv1d's
CUDA build) and passes it no document boundaries (``seq_idx=None``); without mamba_ssm it runs
``torch_forward``, a PyTorch reference that materializes chunk x chunk x heads x state tensors
(out of memory at 340M on an 80 GB GPU: docs/perf-log.md) and also ignores ``cu_seqlens``.

flame's forward computes the same function of the same parameters (fla checkpoints and flame
exports load unchanged) with each document of a packed row on its own:

    in_proj -> z | xBC | dt (fla's split) -> causal depthwise conv, restarting at each document
    -> x | B | C -> SSD scan -> + D x -> gated RMS norm (or x silu(z)) -> out_proj

On CUDA the conv is fla's Triton ``causal_conv1d`` with ``cu_seqlens``, and the scan is
mamba_ssm's Triton SSD kernel (``mamba_chunk_scan_combined``, each token's document as
``seq_idx``; flame.compat.mamba_ssm imports it from a build without CUDA). Without mamba_ssm, or
with several groups (``prefill`` says why), the scan runs as simple GLA's recurrence,
``S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = q_t S_t``, with q = C, k = B (head h reads group
h mod n_groups, as fla's ``torch_forward`` pairs them), v = dt x, g = dt A, dt =
clamp(softplus(dt + dt_bias), dt_limit), A = -exp(A_log): fla's ``chunk_simple_gla``
(``chunk_gla`` where fla refuses simple GLA's backward: ``scan_kernel``) with ``cu_seqlens``;
elsewhere (CPU tests) a chunked PyTorch scan of the same math with the same resets. Decoding
with a cache (``generate`` after the prompt) keeps fla's own path; the prompt's states come
from here.

The documents arrive as the layer's ``cu_seqlens`` argument: fla's models pass their keyword
inputs down to every layer, and flame gives fla models ``cu_seqlens`` (flame.models.inputs).
"""

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flame.compat import mamba_ssm
from flame.compat.fla import gated_chunk_backward_refused
from flame.compat.guard import logger
from flame.models.kernels.selective_scan import document_conv

FLA_MAMBA2 = "fla.layers.mamba2"
CHUNK = 64  # the PyTorch scan's chunk length: any length gives the same result


def forward_keeping_documents_apart(fla_forward: Callable) -> Callable:
    """fla's ``Mamba2.forward`` with flame's prefill; decoding from a cache stays fla's."""
    if getattr(fla_forward, "keeps_documents_apart", False):
        return fla_forward

    @functools.wraps(fla_forward)
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, **kwargs):
        fla_layer = sys.modules[FLA_MAMBA2]
        if hidden_states.shape[1] == 0 or fla_layer.get_layer_cache(self, past_key_values) is not None:
            return fla_forward(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                               cu_seqlens=cu_seqlens, **kwargs)
        output, conv_state, ssm_state = prefill(self, hidden_states, attention_mask, cu_seqlens, use_cache)
        fla_layer.update_layer_cache(self, past_key_values, recurrent_state=ssm_state, conv_state=conv_state,
                                     offset=hidden_states.shape[1])
        return output, None, past_key_values

    forward.keeps_documents_apart = True
    return forward


def prefill(mixer, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
            cu_seqlens: torch.Tensor | None = None, use_cache: bool = False, kernels: bool | None = None):
    """(output, conv states, SSM states) of fla's ``Mamba2`` layer ``mixer`` over whole sequences.

    ``cu_seqlens``: the documents of a single packed row; without, each row is one sequence.
    ``kernels``: fla's Triton conv and scan (default: on CUDA tensors) or flame's PyTorch ones.
    The states (fla's cache layout, one per sequence) are computed with ``use_cache`` only.
    Sizes are read from ``mixer`` when called: under tensor parallelism they are this rank's.
    """
    kernels = hidden_states.is_cuda if kernels is None else kernels
    if cu_seqlens is not None and hidden_states.shape[0] != 1:
        raise ValueError(f"Mamba2 takes cu_seqlens over one row; got {hidden_states.shape[0]} rows")
    dtype = hidden_states.dtype
    padding = attention_mask[:, :, None] if attention_mask is not None and attention_mask.dim() == 2 else None
    if padding is not None:  # fla zeroes padded tokens before the projection and around the conv
        hidden_states = (hidden_states * padding).to(dtype)
    projected = mixer.in_proj(hidden_states)
    # mamba_ssm's SSD kernel: the softplus, the clamp and D x inside; documents by seq_idx; the cache's
    # states as its final (or per-document) states. With several groups it pairs head h with group
    # h // (heads / groups), fla's torch_forward with h mod groups (the pairing kept here): one group only.
    # mamba_ssm has no backward for per-document states: a packed row with a cache and gradients scans on fla's kernels.
    varlen_states_backward = use_cache and cu_seqlens is not None and torch.is_grad_enabled()
    ssd = mamba_ssm.ssd_scan() if kernels and mixer.n_groups == 1 and not varlen_states_backward else None
    training_on_gla = kernels and ssd is None and not use_cache
    if training_on_gla and mixer.n_groups == 1:
        warn_without_ssd()
    if training_on_gla and torch.is_grad_enabled():
        # Training on fla's GLA kernels: only in_proj's output is kept for the backward, which
        # recomputes the conv, the scan and the norm. Kept, their per-key decays and per-head B and
        # C ran an H200 out of memory for mamba2_340M (docs/perf-log.md).
        # mamba_ssm's SSD kernel keeps little: nothing is recomputed.
        y, conv_state, ssm_state = checkpoint(mix, mixer, projected, padding, cu_seqlens, False, kernels, None,
                                              use_reentrant=False)
    else:
        y, conv_state, ssm_state = mix(mixer, projected, padding, cu_seqlens, use_cache, kernels, ssd)
    return mixer.out_proj(y.to(dtype)), conv_state, ssm_state


@functools.cache
def warn_without_ssd() -> None:
    logger.warning(
        "mamba2 trains on fla's GLA kernels here, about 2.6x slower than on mamba_ssm's SSD kernel (docs/perf-log.md), "
        "since mamba_ssm is not installed: bash 3rdparty/install.sh installs its Triton kernels, or "
        f"{mamba_ssm.INSTALL}"
    )


def mix(mixer, projected: torch.Tensor, padding: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        use_cache: bool, kernels: bool, ssd: Callable | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``prefill`` from in_proj's output to out_proj's input: conv, SSD scan, skip term and gated norm.

    ``ssd``: mamba_ssm's ``mamba_chunk_scan_combined`` for the scan, else fla's kernels or PyTorch.
    """
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    inner = mixer.intermediate_size
    d_mlp = (projected.shape[-1] - 2 * inner - 2 * groups * state - heads) // 2
    _, _, gate, xbc, dt = projected.split([d_mlp, d_mlp, inner, mixer.conv_dim, heads], dim=-1)
    if padding is not None:
        xbc = (xbc * padding).to(xbc.dtype)
    conv_state = last_inputs(xbc, mixer.conv_kernel_size, cu_seqlens) if use_cache else None
    xbc = (conv_kernel if kernels else conv_torch)(mixer, xbc, cu_seqlens)
    if padding is not None:
        xbc = (xbc * padding).to(xbc.dtype)
    x, B, C = xbc.split([inner, groups * state, groups * state], dim=-1)

    A = -torch.exp(mixer.A_log.float())
    x = x.unflatten(-1, (heads, head_dim))
    if ssd is not None:
        states = {}  # the cache's: [sequences, heads, head_dim, state]
        if use_cache:
            states = {"return_final_states": True} if cu_seqlens is None else \
                {"return_varlen_states": True, "cu_seqlens": cu_seqlens}
        y = ssd(x, dt, A, B.unflatten(-1, (groups, state)), C.unflatten(-1, (groups, state)), mixer.chunk_size,
                D=mixer._get_D(), dt_bias=mixer.dt_bias, seq_idx=document_index(xbc.shape[1], cu_seqlens, xbc.device),
                dt_softplus=True, dt_limit=tuple(mixer.dt_limit), **states)
        y, ssm_state = (y[0], y[1].float()) if use_cache else (y, None)
        y = y.flatten(-2)
        return (mixer.norm(y, gate) if mixer.rmsnorm else y * mixer.act(gate)), conv_state, ssm_state
    dt = torch.clamp(F.softplus(dt + mixer.dt_bias), mixer.dt_limit[0], mixer.dt_limit[1]).float()
    x = x.float()
    # head h reads group h mod n_groups (fla's torch_forward repeats the groups)
    B, C = (t.unflatten(-1, (groups, state)).repeat(1, 1, heads // groups, 1) for t in (B, C))
    v, g = x * dt[..., None], dt * A
    if kernels:
        y, ssm_state = scan_kernel(C, B, v.to(projected.dtype), g, cu_seqlens, use_cache)
    else:
        y, ssm_state = scan_torch(C.float(), B.float(), v, g, cu_seqlens, use_cache)
    y = (y.float() + x * mixer._get_D(expand_to_head_dim=True)).flatten(-2)
    y = mixer.norm(y, gate) if mixer.rmsnorm else y * mixer.act(gate)
    return y, conv_state, ssm_state


def last_inputs(xbc: torch.Tensor, width: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's last ``width`` conv inputs, zeros before its start: fla's conv cache [N, channels, width]."""
    if cu_seqlens is None:
        return F.pad(xbc.transpose(1, 2), (width - xbc.shape[1], 0))
    taken = cu_seqlens[1:, None].long() - width + torch.arange(width, device=xbc.device)
    inside = (taken >= cu_seqlens[:-1, None]).to(xbc.dtype)
    return (xbc[0, taken.clamp(min=0)] * inside[..., None]).transpose(1, 2)


def conv_kernel(mixer, xbc: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """fla's Triton causal conv (restarting at each document), then the layer's activation."""
    from fla.modules.causal_conv1d import causal_conv1d

    fused = mixer.activation in ("silu", "swish")  # the kernel's one activation
    out, _ = causal_conv1d(x=xbc, weight=mixer.conv1d.weight.squeeze(1), bias=mixer.conv1d.bias,
                           activation=mixer.activation if fused else None, cu_seqlens=cu_seqlens)
    return out if fused else mixer.act(out)


def document_index(length: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """mamba_ssm's ``seq_idx`` of a packed row: each token's document, [1, length] int32 (None: one sequence)."""
    return None if cu_seqlens is None else positions(length, cu_seqlens, device)[0].to(torch.int32)[None]


def positions(length: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within it) of each token of a row."""
    index = torch.arange(length, device=device)
    if cu_seqlens is None:
        return torch.zeros_like(index), index
    document = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
    return document, index - cu_seqlens.long()[document]


def conv_torch(mixer, xbc: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The layer's depthwise causal conv and activation in PyTorch, no input reaching across a document start."""
    return mixer.act(document_conv(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, cu_seqlens))


def scan_kernel(q, k, v, g, cu_seqlens, final_states: bool, per_key_decay: bool | None = None):
    """fla's chunked simple-GLA kernel: o_t = q_t S_t, S_t = exp(g_t) S_{t-1} + k_t v_t^T, restarting per document.

    With ``per_key_decay`` (default: where a backward will run and fla refuses simple GLA's, Hopper
    with Triton 3.4 to 3.7.0: flame.compat.fla.gated_chunk_backward_refused; TileLang does not
    replace it for simple GLA) fla's GLA kernel runs it instead, each head's decay repeated over its
    keys: the same recurrence, with its own backward, at the cost of a float32 decay per key and token.
    """
    if per_key_decay is None:
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g))
        per_key_decay = backward and gated_chunk_backward_refused()
    if per_key_decay:
        from fla.ops.gla import chunk_gla

        per_key = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()
        o, states = chunk_gla(q, k, v, per_key, scale=1.0, output_final_state=final_states, state_v_first=True,
                              cu_seqlens=cu_seqlens)
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        o, states = chunk_simple_gla(q, k, v, g, scale=1.0, output_final_state=final_states, state_v_first=True,
                                     cu_seqlens=cu_seqlens)
    return o, states.float() if final_states else None


def scan_torch(q, k, v, g, cu_seqlens, final_states: bool, chunk: int = CHUNK):
    """``scan_kernel``'s recurrence in PyTorch, chunk by chunk (float32; states [N, heads, value, key]).

    Within a chunk, token i reads token j <= i of its own document with weight exp(G_i - G_j)
    (G: the chunk's running sum of g); the state entering a chunk reaches the tokens that
    continue the document it belongs to, decayed by exp(G_i).
    """
    rows, length, heads, _ = k.shape
    document, _ = positions(length, cu_seqlens, k.device)
    pad = -length % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, chunk)) for t in (q, k, v))
    G = F.pad(g, (0, 0, 0, pad)).unflatten(1, (-1, chunk)).cumsum(2)  # [rows, chunks, chunk, heads]
    document = F.pad(document, (0, pad), value=-1).view(-1, chunk)  # padding: a document of its own
    chunks = document.shape[0]

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    reads = (document[:, :, None] == document[:, None, :]) & causal  # [chunks, i, j]
    decay = (G[:, :, :, None] - G[:, :, None]).masked_fill(~reads[None, ..., None], float("-inf")).exp()
    o = torch.einsum("bcijh,bcjhp->bcihp", torch.einsum("bcihn,bcjhn->bcijh", q, k) * decay, v)

    # each chunk's contribution to the state at its end (its last document's tokens), and whether the
    # state entering it reaches that end (no document starts inside it)
    to_end = (G[:, :, -1:] - G).exp() * (document == document[:, -1:])[None, ..., None]
    local = torch.einsum("bcjhn,bcjhp->bchpn", to_end[..., None] * k, v)
    before = torch.cat([document.new_full((1,), -2), document[:-1, -1]])  # the document of the token before each chunk
    continues = (document == before[:, None]).to(G.dtype)  # [chunks, i]
    entering, carried = [], k.new_zeros(rows, heads, v.shape[-1], k.shape[-1])
    for c in range(chunks):
        entering.append(carried)
        carried = carried * G[:, c, -1].exp()[..., None, None] * continues[c, -1] + local[:, c]
    entering = torch.stack(entering, 1)  # [rows, chunks, heads, value, key]
    reach = G.exp() * continues[None, ..., None]
    o = o + torch.einsum("bcih,bcihn,bchpn->bcihp", reach, q, entering)
    o = o.flatten(1, 2)[:, :length]
    if not final_states:
        return o, None
    # the state after each sequence's last token
    ends = (cu_seqlens[1:].long() - 1) if cu_seqlens is not None else torch.tensor([length - 1], device=k.device)
    c, i = ends // chunk, ends % chunk
    own = torch.einsum("bmjhn,bmjhp->bmhpn", decay[:, c, i][..., None] * k[:, c], v[:, c])
    states = own + entering[:, c] * reach[:, c, i][..., None, None]
    return o, states.flatten(0, 1)
