"""fla's Mamba layer (model types mamba and samba) with flame's selective scan: fast, and documents kept apart.

Written for fla-core 0.6.0, whose ``fla.layers.mamba.Mamba`` trains with mamba_ssm's and
causal_conv1d's CUDA kernels where they are installed (``mamba_inner_fn``, ``selective_scan_fn``)
and with a token-by-token PyTorch scan where not; neither takes ``cu_seqlens``, so packed
documents shared their state. flame.compat.apply_after_fla_import applies this change.
"""

import importlib

import torch
import torch.nn.functional as F

from flame.compat.fla import FLA
from flame.compat.guard import Target, patch

_MAMBA = Target(FLA, "fla.layers.mamba", "Mamba.forward",
                ("self", "hidden_states", "attention_mask", "past_key_values", "use_cache", "output_attentions"))
_CONV = Target(FLA, "fla.modules.causal_conv1d", "causal_conv1d",
               ("x", "weight", "bias", "residual", "initial_state", "output_final_state", "activation", "backend",
                "cu_seqlens"))


def mamba_mix(
    layer, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """fla's Mamba layer's output, every document (of ``cu_seqlens``, or every row) starting from zero state.

    fla's computation, in its order: in_proj -> causal conv + SiLU -> x_proj (dt, B, C) -> dt_proj ->
    selective scan gated by SiLU(z) -> out_proj. The scan adds dt_proj's bias in float32 before
    the softplus, as mamba_ssm's kernels do. A padding mask zeroes the padded tokens before and
    after the convolution, as fla's layer does.
    """
    # imported here: flame.compat imports none of flame.models
    from flame.models.selective_scan import document_conv, selective_scan

    if layer.activation not in ("silu", "swish"):
        raise ValueError(f"fla's Mamba layer with hidden_act {layer.activation!r}: flame's scan gates by SiLU only")
    x, z = layer.in_proj(hidden_states).chunk(2, dim=-1)
    mask = None if attention_mask is None else attention_mask[..., None].to(x.dtype)
    if mask is not None:
        x = x * mask
    weight = layer.conv1d.weight.squeeze(1)  # [D, kernel width]
    bias = layer.conv1d.bias if layer.use_conv_bias else None
    if x.is_cuda:
        conv = importlib.import_module(_CONV.module).causal_conv1d
        x, _ = conv(x=x.contiguous(), weight=weight, bias=bias, activation="silu", cu_seqlens=cu_seqlens)
    else:
        x = F.silu(document_conv(x, weight, bias, cu_seqlens))
    if mask is not None:
        x = x * mask
    dt, B, C = torch.split(layer.x_proj(x), [layer.dt_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1)
    dt = F.linear(dt, layer.dt_proj.weight)  # its bias: inside the scan, in float32
    A = -torch.exp(layer.A_log.float())
    y = selective_scan(x, dt, A, B, C, layer.D.float(), z, layer.dt_proj.bias.float(), cu_seqlens)
    return layer.out_proj(y)


@patch(FLA, _MAMBA, _CONV)
def mamba_scans_documents() -> None:
    """Give fla's Mamba layer (mamba, samba) flame's selective scan in training and prefill.

    Upstream: without mamba_ssm's and causal_conv1d's CUDA builds (they compile with nvcc; no GPU
    image here has them) the layer scans token by token in PyTorch, 1k tokens/s on a tiny model;
    with them or without, it ignores ``cu_seqlens``, so a packed document starts from the state
    the previous one left (docs/models.md).
    flame: a forward without a cache (training, validation, scoring) runs ``mamba_mix``: fla's
    causal_conv1d Triton kernel, which restarts at every document, and flame's selective scan
    (flame.models.selective_scan: Triton kernels on GPUs, a PyTorch loop on CPUs), whose state
    restarts at every document. Same parameters, same math. Decoding with a cache (``generate``)
    keeps fla's path, which takes one sequence per row: given packed documents there, it refuses.
    """
    layer = importlib.import_module(_MAMBA.module)
    original = layer.Mamba.forward

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, **kwargs):
        if use_cache or past_key_values is not None or hidden_states.shape[1] == 0:
            if cu_seqlens is not None and cu_seqlens.numel() > 2:
                raise ValueError("fla's Mamba layer decodes with a cache one sequence per row, not packed documents "
                                 "(cu_seqlens): pass one sequence per row")
            return original(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                            **kwargs)
        return mamba_mix(self, hidden_states, cu_seqlens, attention_mask), None, past_key_values

    forward.scans_documents = True
    layer.Mamba.forward = forward

