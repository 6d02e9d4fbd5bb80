"""fla's Triton kernels swapped for PyTorch equivalents, so that fla models run on CPU (no Triton driver).

    from tests.scripts.torch_kernels import use_torch_kernels
    use_torch_kernels(model)   # fla's norms, gated norms, rotary, swiglu and gla's recurrence

Used by tp_grad_parity.py (tensor parallelism on CPU) and tests/models/test_mamba2_kernels.py.
"""

import itertools
import types

import torch
import torch.nn.functional as F


def _rms_norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    residual = x
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight
    y = y + self.bias if self.bias is not None else y
    return (y, residual) if prenorm else y


def _rms_norm_gated(self, x, z=None):
    if z is not None and not self.norm_before_gate:
        x = x * F.silu(z)
    groups = x.unflatten(-1, (-1, self.group_size))
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight
    return y * F.silu(z) if z is not None and self.norm_before_gate else y


def _rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    assert not interleaved and isinstance(seqlen_offsets, int)
    rows, length = x.shape[:2]
    positions = torch.arange(rows * length) + seqlen_offsets
    if cu_seqlens is not None:  # positions restart at each sequence of the packed row
        positions = positions - cu_seqlens[torch.searchsorted(cu_seqlens[1:], positions, right=True)]
    cos, sin = (t[positions.view(rows, length)][:, :, None] for t in (cos, sin))
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def _fused_rms_norm_gated(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    assert residual is None and not prenorm and self.activation in ("swish", "silu")
    return _rms_norm(self, x) * F.silu(g)


def gla_recurrence(q, k, v, gk=None, g=None, scale=None, cu_seqlens=None, **unused):
    """fla's gated linear attention, one token at a time: h = exp(gate) * h + k v^T, o = scale q h."""
    gate = gk if gk is not None else g
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows, length, heads, _ = q.shape
    edges = cu_seqlens.tolist() if cu_seqlens is not None else [0, length]
    outputs = []
    for row in range(rows):
        for start, end in itertools.pairwise(edges):  # the state restarts at each document
            state = q.new_zeros(heads, q.shape[-1], v.shape[-1])
            for t in range(start, end):
                state = state * gate[row, t].exp()[..., None] + k[row, t][..., None] * v[row, t][:, None]
                outputs.append(torch.einsum("hk,hkv->hv", q[row, t] * scale, state))
    return torch.stack(outputs).view(rows, length, heads, -1), None


def _swiglu_linear(x, y, weight, bias):
    return F.linear(F.silu(x) * y, weight, bias)


def use_torch_kernels(model: torch.nn.Module) -> None:
    from fla.layers import gla
    from fla.layers.mamba2 import Mamba2
    from fla.modules import FusedRMSNormGated, RMSNorm, mlp
    from fla.modules.norm.layernorm_gated import RMSNormGated
    from fla.modules.rotary import ops as rotary

    rotary.rotary_embedding = _rotary
    mlp.swiglu = lambda x, y: F.silu(x) * y
    mlp.swiglu_linear = _swiglu_linear
    gla.chunk_gla = gla.fused_recurrent_gla = gla_recurrence

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_rms_norm, module)
        elif isinstance(module, FusedRMSNormGated):
            module.forward = types.MethodType(_fused_rms_norm_gated, module)
        elif isinstance(module, RMSNormGated):
            module.forward = types.MethodType(_rms_norm_gated, module)
        elif isinstance(module, Mamba2):
            module.act = F.silu
