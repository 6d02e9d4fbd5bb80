"""Mamba's selective scan and causal convolution over packed documents, each document starting from zero state.

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d],   dt_t = softplus(dt_raw_t + dt_bias)
    y_t[d] = (sum_n C_t[n] h_t[d, n] + D[d] x_t[d]) silu(z_t[d])

the recurrence of fla's ``Mamba`` layer (and mamba_ssm's ``selective_scan_fn`` with ``delta_softplus``),
with the state reset at every document start (``cu_seqlens`` over the flattened batch) and every
row start. ``selective_scan`` runs flame's Triton kernels on CUDA tensors
(flame.models.kernels.selective_scan_triton: float32 state, chunked over time) and ``reference_scan``,
a token-by-token PyTorch loop, elsewhere; the tests hold the two to each other.
"""

import torch
import torch.nn.functional as F
import triton

# tokens per chunk (the kernels' unit of parallel work over time) and channels per program;
# the backward holds more per token, hence its narrower blocks
CHUNK, BLOCK_D, BACKWARD_BLOCK_D, CARRY_BLOCK = 64, 32, 16, 256


def document_starts(rows: int, length: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """int8 [rows * length]: 1 where a document (or a row) starts."""
    starts = torch.zeros(rows * length, dtype=torch.int8, device=device)
    starts[::length] = 1
    if cu_seqlens is not None:
        starts[cu_seqlens[:-1].long()] = 1
    return starts


def document_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Causal depthwise convolution of x [rows, T, D] by weight [D, K], restarting at every document (PyTorch).

    The same as nn.Conv1d(groups=D, padding=K-1) cut to T, with no tap reaching before its
    document's start; the caller applies the layer's activation. The CPU path of fla's Mamba
    and Mamba2 layers under flame (flame.compat.fla_mamba).
    """
    rows, length, channels = x.shape
    flat = x.reshape(rows * length, channels)
    starts = document_starts(rows, length, cu_seqlens, x.device).bool()
    index = torch.arange(rows * length, device=x.device)
    position = index - torch.cummax(torch.where(starts, index, 0), dim=0).values  # within its document
    width = weight.shape[1]
    out = flat * weight[:, width - 1]
    for k in range(1, width):
        shifted = F.pad(flat[:-k], (0, 0, k, 0))
        out = out + torch.where((position >= k)[:, None], shifted, 0) * weight[:, width - 1 - k]
    if bias is not None:
        out = out + bias
    return out.reshape(rows, length, channels)


def reference_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    z: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated scan token by token (float32 state): x, dt_raw, z [rows, T, D]; B, C [rows, T, N]; A [D, N]."""
    rows, length, channels = x.shape
    starts = document_starts(rows, length, cu_seqlens, x.device).tolist()
    x_, dt_, B_, C_, z_ = (v.reshape(rows * length, -1).float() for v in (x, dt, B, C, z))
    delta = F.softplus(dt_ + dt_bias.float())
    h = x_.new_zeros(channels, A.shape[1])
    outputs = []
    for t, start in enumerate(starts):
        decay = torch.zeros_like(h) if start else torch.exp(delta[t, :, None] * A)
        h = decay * h + (delta[t] * x_[t])[:, None] * B_[t][None, :]
        outputs.append(h @ C_[t])
    y = (torch.stack(outputs) + x_ * D.float()) * F.silu(z_)
    return y.reshape(rows, length, channels).to(x.dtype)


def _rows(v: torch.Tensor) -> torch.Tensor:
    """[rows, T, width] -> [rows * T, width] with unit stride along width (a view where it can be)."""
    v = v.reshape(-1, v.shape[-1])
    return v if v.stride(-1) == 1 else v.contiguous()


class _TritonScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, starts, chunk, block_d, backward_block_d):
        from flame.models.kernels import selective_scan_triton as kernels

        shape = x.shape
        x, dt, B, C, z = map(_rows, (x, dt, B, C, z))
        A, D, dt_bias = (v.float().contiguous() for v in (A, D, dt_bias))
        (tokens, channels), states = x.shape, A.shape[1]
        chunks = triton.cdiv(tokens, chunk)
        grid = (chunks, triton.cdiv(channels, block_d))
        local = x.new_empty(chunks, channels, states, dtype=torch.float32)
        decay = torch.empty_like(local)
        kernels._chunk_summary[grid](
            dt, dt_bias, A, starts, x, x, B, local, decay, tokens, channels, dt.stride(0), x.stride(0), x.stride(0),
            B.stride(0), N=states, CHUNK=chunk, BLOCK_D=block_d, BACKWARD=False,
        )
        start = x.new_empty(chunks + 1, channels, states, dtype=torch.float32)
        kernels._carry[(triton.cdiv(channels * states, CARRY_BLOCK),)](
            local, decay, start, chunks, channels * states, BLOCK=CARRY_BLOCK, BACKWARD=False,
        )
        y = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
        kernels._chunk_forward[grid](
            x, dt, dt_bias, A, B, C, D, z, starts, start, y, tokens, channels,
            x.stride(0), dt.stride(0), B.stride(0), C.stride(0), z.stride(0), y.stride(0),
            N=states, CHUNK=chunk, BLOCK_D=block_d,
        )
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, starts, start)
        ctx.chunk, ctx.block_d = chunk, backward_block_d
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dout):
        from flame.models.kernels import selective_scan_triton as kernels

        x, dt, A, B, C, D, z, dt_bias, starts, start = ctx.saved_tensors
        chunk, block_d = ctx.chunk, ctx.block_d
        shape = dout.shape
        dout = _rows(dout)
        (tokens, channels), states = x.shape, A.shape[1]
        chunks, blocks = triton.cdiv(tokens, chunk), triton.cdiv(channels, block_d)
        local = x.new_empty(chunks, channels, states, dtype=torch.float32)
        decay = torch.empty_like(local)
        kernels._chunk_summary[(chunks, triton.cdiv(channels, BLOCK_D))](
            dt, dt_bias, A, starts, dout, z, C, local, decay, tokens, channels, dt.stride(0), dout.stride(0),
            z.stride(0), C.stride(0), N=states, CHUNK=chunk, BLOCK_D=BLOCK_D, BACKWARD=True,
        )
        adjoint = torch.empty_like(local)
        kernels._carry[(triton.cdiv(channels * states, CARRY_BLOCK),)](
            local, decay, adjoint, chunks, channels * states, BLOCK=CARRY_BLOCK, BACKWARD=True,
        )
        dx = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
        ddt = torch.empty(tokens, channels, dtype=dt.dtype, device=x.device)
        dz = torch.empty(tokens, channels, dtype=z.dtype, device=x.device)
        dB = x.new_empty(blocks, tokens, states, dtype=torch.float32)
        dC = torch.empty_like(dB)
        dA = torch.empty_like(local)
        dD = x.new_empty(chunks, channels, dtype=torch.float32)
        dbias = torch.empty_like(dD)
        kernels._chunk_backward[(chunks, blocks)](
            x, dt, dt_bias, A, B, C, D, z, starts, start, adjoint, dout, dx, ddt, dz, dB, dC, dA, dD, dbias,
            tokens, channels, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), z.stride(0), dout.stride(0),
            N=states, CHUNK=chunk, BLOCK_D=block_d,
        )
        rows = shape[:-1]
        return (
            dx.reshape(shape), ddt.reshape(shape), dA.sum(0), dB.sum(0).to(B.dtype).reshape(*rows, states),
            dC.sum(0).to(C.dtype).reshape(*rows, states), dD.sum(0), dz.reshape(shape), dbias.sum(0),
            None, None, None, None,
        )


def triton_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    z: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
    chunk: int = CHUNK, block_d: int = BLOCK_D, backward_block_d: int = BACKWARD_BLOCK_D,
) -> torch.Tensor:
    """``reference_scan`` by flame's Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    starts = document_starts(x.shape[0], x.shape[1], cu_seqlens, x.device)
    return _TritonScan.apply(x, dt, A, B, C, D, z, dt_bias, starts, chunk, block_d, backward_block_d)


@torch.compiler.disable  # Triton launches and their grids stay outside compiled blocks (a graph break per layer)
def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    z: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [rows, T, D] in x's dtype; resets at every document of ``cu_seqlens`` and every row. Triton on CUDA."""
    scan = triton_scan if x.is_cuda else reference_scan
    return scan(x, dt, A, B, C, D, z, dt_bias, cu_seqlens)
