"""Kernels that restart at every document, in place of a transformers hybrid's sequence kernels (GPUs).

A transformers hybrid's recurrent and convolutional layers (flame.models.hybrid) call kernels of their modeling
module with no document boundaries. On GPUs flame runs each such layer over the batch flattened into one row
and puts these in place of those kernels (flame.compat.transformers.kernels_take_documents); each passes the
documents of the batch being computed (flame.base.batch_context) to a kernel that restarts at each:

    causal_conv1d_fn                    fla's causal_conv1d, cu_seqlens
    torch_chunk_gated_delta_rule        fla's chunk_gated_delta_rule, cu_seqlens
    chunk_kimi_delta_attention          fla's chunk_kda, cu_seqlens
    mamba2_chunk_scan                   mamba_ssm's SSD scan, seq_idx; without mamba_ssm fla's simple GLA,
                                        cu_seqlens (flame.models.kernels.mamba2)
    mamba2_split_conv1d_scan_combined   none: the layer takes its unfused path, through the two kernels above
    mamba_selective_scan                flame's selective scan, cu_seqlens (flame.models.kernels.selective_scan)

Each is a factory: given the kernel it replaces, it returns the kernel to call, which calls the replaced one
outside a batch with documents (``generate``, scoring an export). The computations are upstream's (on GPUs
transformers itself picks fla's gated delta rule and KDA kernels); only the documents are new.
"""

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from flame.base import batch_context
from flame.compat import mamba_ssm
from flame.compat.fla import FLA
from flame.compat.guard import Target
from flame.models import registry
from flame.models.kernels import mamba2
from flame.models.kernels import selective_scan as scans


def _takes_cu_seqlens(kernel: Callable) -> bool:
    return "cu_seqlens" in inspect.signature(kernel).parameters


def _fla_kernel(module: str, name: str) -> Target:
    return Target(FLA, module, name, ("q", "k", "v", "g", "beta"), _takes_cu_seqlens, "a kernel taking cu_seqlens")


CONV = Target(FLA, "fla.modules.causal_conv1d", "causal_conv1d", ("x", "weight", "bias"), _takes_cu_seqlens,
              "a kernel taking cu_seqlens")
GATED_DELTA_RULE = _fla_kernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
KIMI_DELTA_RULE = _fla_kernel("fla.ops.kda", "chunk_kda")


def check() -> None:
    """Import fla (flame's one import: flame.models.registry) and refuse an fla without the kernels called here."""
    registry.import_fla()
    for target in (CONV, GATED_DELTA_RULE, KIMI_DELTA_RULE):
        target.require("flame.models.kernels.varlen")


def _documents(x: torch.Tensor) -> torch.Tensor | None:
    """The cu_seqlens of the batch being computed, or None outside a batch with documents."""
    batch = batch_context.current()
    if batch is None or batch.cu_seqlens is None:
        return None
    if x.shape[0] != 1:  # flame.models.hybrid flattens the batch before the layer runs
        raise RuntimeError(f"a hybrid layer's kernel got {x.shape[0]} rows of a batch with documents, not the batch "
                           "flattened into one row; this is a bug in flame")
    return batch.cu_seqlens


def causal_conv(replaced: Callable) -> Callable:
    """transformers' ``causal_conv1d_fn``: x [1, channels, T], weight [channels, width], then the activation."""

    @functools.wraps(replaced)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = _documents(hidden_states)
        if cu_seqlens is None:
            return replaced(hidden_states, weight, bias, activation=activation, **kwargs)
        fused = activation in ("silu", "swish")  # the one activation fla's kernel applies itself
        out, _ = CONV.resolve()(x=hidden_states.transpose(1, 2).contiguous(), weight=weight, bias=bias,
                                activation=activation if fused else None, cu_seqlens=cu_seqlens)
        if activation is not None and not fused:
            out = ACT2FN[activation](out)
        return out.transpose(1, 2).to(hidden_states.dtype)

    return conv


def delta_rule(kernel: Target) -> Callable[[Callable], Callable]:
    """transformers' chunked delta rule (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``) by fla's
    ``kernel``, which takes the same arguments: q, k [1, T, heads, key], v [1, T, heads, value], g, beta."""

    def factory(replaced: Callable) -> Callable:
        @functools.wraps(replaced)
        def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
            cu_seqlens = _documents(query)
            if cu_seqlens is None:
                return replaced(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                **kwargs)
            return kernel.resolve()(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                    output_final_state=output_final_state,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

        return rule

    return factory


def mamba2_scan(replaced: Callable) -> Callable:
    """transformers' Mamba-2 chunk scan: x [1, T, heads, head_dim], dt [1, T, heads], A [heads], B and C
    [1, T, groups, state] (head h reads group h // (heads / groups)); dt's bias, softplus and clamp, and D x inside."""

    @functools.wraps(replaced)
    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), **kwargs):
        cu_seqlens = _documents(hidden_states)
        if cu_seqlens is None:
            return replaced(hidden_states, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, **kwargs)
        ssd = mamba_ssm.ssd_scan()
        if ssd is not None:  # its head-to-group pairing is transformers'
            documents = mamba2.document_index(hidden_states.shape[1], cu_seqlens, hidden_states.device)
            return ssd(hidden_states, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, seq_idx=documents,
                       dt_softplus=dt_softplus, dt_limit=tuple(dt_limit))
        mamba2.warn_without_ssd()
        # S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T, y_t = C_t S_t: simple GLA's recurrence with q = C, k = B
        if dt_bias is not None:
            dt = dt + dt_bias
        dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit).float()
        x = hidden_states.float()
        heads = x.shape[2]
        B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
        y, _ = mamba2.scan_kernel(C, B, (x * dt[..., None]).to(hidden_states.dtype), dt * A, cu_seqlens, False)
        y = y.float()
        if D is not None:
            y = y + x * D[:, None]
        if z is not None:
            y = y * F.silu(z.float())
        return y.to(hidden_states.dtype)

    return scan


def unfused(replaced: Callable) -> Callable:
    """transformers' fused Mamba-2 layer kernel (mamba_ssm's, where mamba_ssm imports whole), which takes no documents:
    none inside a batch with documents (the layer then runs its unfused path: ``causal_conv``, ``mamba2_scan``)."""

    @functools.wraps(replaced)
    def fused(projected, *args, **kwargs):
        if _documents(projected) is not None:
            return None
        return replaced(projected, *args, **kwargs)

    return fused


def selective_scan(replaced: Callable) -> Callable:
    """transformers' Mamba scan as jamba calls it: x, dt, z [1, channels, T], A [channels, state], B and C
    [1, state, T]; dt's bias and softplus, D x and the SiLU(z) gate inside (flame's scan computes that one)."""

    @functools.wraps(replaced)
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
        cu_seqlens = _documents(hidden_states)
        if cu_seqlens is None:
            return replaced(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, **kwargs)
        x, dt, B, C, z = (t.transpose(1, 2) for t in (hidden_states, dt, B, C, z))
        y = scans.selective_scan(x, dt, A, B, C, D, z, delta_bias, cu_seqlens)
        return y.transpose(1, 2)

    return scan
