"""fla's Mamba layer (model types mamba and samba) computed by flame's selective scan, each document from zero state.

flame.compat.fla_mamba puts ``mamba_mix`` in place of the layer's training forward (its docstring says why).
"""

import importlib

import torch
import torch.nn.functional as F

from flame.models.kernels.selective_scan import document_conv, selective_scan

FLA_CAUSAL_CONV = "fla.modules.causal_conv1d"  # fla's Triton causal conv, which takes cu_seqlens


def mamba_mix(
    layer, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """fla's Mamba layer's output, every document (of ``cu_seqlens``, or every row) starting from zero state.

    fla's computation, in its order: in_proj -> causal conv + SiLU -> x_proj (dt, B, C) -> dt_proj ->
    selective scan gated by SiLU(z) -> out_proj. The scan adds dt_proj's bias in float32 before
    the softplus, as mamba_ssm's kernels do. A padding mask zeroes the padded tokens before and
    after the convolution, as fla's layer does.
    """
    if layer.activation not in ("silu", "swish"):
        raise ValueError(f"fla's Mamba layer with hidden_act {layer.activation!r}: flame's scan gates by SiLU only")
    x, z = layer.in_proj(hidden_states).chunk(2, dim=-1)
    mask = None if attention_mask is None else attention_mask[..., None].to(x.dtype)
    if mask is not None:
        x = x * mask
    weight = layer.conv1d.weight.squeeze(1)  # [D, kernel width]
    bias = layer.conv1d.bias if layer.use_conv_bias else None
    if x.is_cuda:
        conv = importlib.import_module(FLA_CAUSAL_CONV).causal_conv1d
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
