"""Triton kernels of Mamba's selective scan over packed documents (flame.models.kernels.selective_scan).

Tokens are flattened to one axis of ``T``; ``reset[t]`` is 1 where a document starts. With
``dt = softplus(dt_raw + dt_bias)``, ``a_t = exp(dt_t A) * (1 - reset_t)`` and ``b_t = dt_t x_t B_t``:

    h_t = a_t h_{t-1} + b_t          (state [D, N], float32)
    y_t = (C_t . h_t + D x_t) * silu(z_t)

The time axis is cut into chunks of ``CHUNK`` tokens, each (chunk, channel block) one program,
so that a single long row still fills the GPU:
1. ``_chunk_summary``: each chunk's end state from a zero start, and its decay ``P = prod a``;
2. ``_carry``: one sequential pass over the chunks' summaries: every chunk's start state;
3. ``_chunk_forward``: each chunk scans again from its start state (``tl.associative_scan``
   of the pairs (a, b)) and writes its outputs.
The start states are all the forward keeps besides its inputs. Backward mirrors it: the adjoint
``g_t = a_{t+1} g_{t+1} + C_t dy_t`` runs backward in time with the same summaries and carry,
and ``_chunk_backward`` scans both directions inside a chunk, from the saved start state and the
carried adjoint, to form every gradient. Gradients summed over channels (dB, dC) or over time
(dA, dD, dt_bias) are written per program and summed by the caller: no atomics, deterministic.
"""

import triton
import triton.language as tl


@triton.jit
def _softplus(v):  # log1p(exp(v)) as torch's softplus; log1p(u) = log(1 + u) u / ((1 + u) - 1) keeps small u exact
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    return tl.where(v > 20.0, v, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))


@triton.jit
def _combine(a1, b1, a2, b2):  # (a1, b1) then (a2, b2): h -> a2 (a1 h + b1) + b2
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _load_dt(dt_ptr, bias_ptr, t, d, mask, stride_dt, D):
    raw = tl.load(dt_ptr + t[:, None] * stride_dt + d[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=d < D, other=0.0)
    return raw + bias[None, :]


@triton.jit
def _chunk_summary(
    dt_ptr, bias_ptr, a_ptr, reset_ptr, w_ptr, z_ptr, s_ptr, out_ptr, decay_ptr,
    T, D, stride_dt, stride_w, stride_z, stride_s,
    N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    """Per chunk and state: the chunk's contribution to the carry, and its decay ``P = prod a`` ([chunks, D, N]).

    Forward (w = x, s = B): sum_t prod_{s>t} a_s dt_t x_t B_t[n], the chunk's end state from a zero start.
    Backward (w = dout, z, s = C): sum_t prod_{s<=t} a_s C_t[n] dy_t with dy = dout silu(z), the adjoint
    the chunk hands to the previous one.
    """
    c, pd = tl.program_id(0), tl.program_id(1)
    t = c * CHUNK + tl.arange(0, CHUNK)
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    in_t, in_d = t < T, d < D
    mask = in_t[:, None] & in_d[None, :]
    dt = tl.where(mask, _softplus(_load_dt(dt_ptr, bias_ptr, t, d, mask, stride_dt, D)), 0.0)
    w = tl.load(w_ptr + t[:, None] * stride_w + d[None, :], mask=mask, other=0.0).to(tl.float32)
    reset = tl.load(reset_ptr + t, mask=in_t, other=0) != 0
    local = tl.arange(0, CHUNK)
    cum = tl.cumsum(dt, axis=0)  # inclusive
    total = tl.sum(dt, axis=0)
    if BACKWARD:  # the tokens before the chunk's first reset pass their adjoint back
        first_reset = tl.min(tl.where(reset, local, CHUNK), axis=0)
        live = (local < first_reset)[:, None]
        span = cum  # sum of dt over [first, t]
        z = tl.load(z_ptr + t[:, None] * stride_z + d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = w * z * tl.sigmoid(z)  # dy
    else:  # the tokens from the chunk's last reset on reach its end
        last_reset = tl.max(tl.where(reset, local, 0), axis=0)
        live = (local >= last_reset)[:, None]
        span = total[None, :] - cum  # sum of dt over (t, last]
        w = w * dt
    no_reset = tl.max(reset.to(tl.int32), axis=0) == 0
    for n in range(N):
        a_n = tl.load(a_ptr + d * N + n, mask=in_d, other=0.0)
        scale = tl.load(s_ptr + t * stride_s + n, mask=in_t, other=0.0).to(tl.float32)
        weight = tl.where(live, tl.exp(span * a_n[None, :]), 0.0)
        contribution = tl.sum(weight * w * scale[:, None], axis=0)
        decay = tl.where(no_reset, tl.exp(total * a_n), 0.0)
        offset = (c * D + d) * N + n
        tl.store(out_ptr + offset, contribution, mask=in_d)
        tl.store(decay_ptr + offset, decay, mask=in_d)


# CHUNKS stays a runtime value: Triton compiles an integer argument equal to 1 as a constant, and
# its 3.6 compiler then crashes on the backward loop that never runs (one chunk: a short sequence)
@triton.jit(do_not_specialize=["CHUNKS"])
def _carry(local_ptr, decay_ptr, carry_ptr, CHUNKS, DN, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Forward: start[c + 1] = P[c] start[c] + local[c] from start[0] = 0 (carry has CHUNKS + 1 rows).
    Backward: out[c - 1] = local[c] + P[c] out[c] from out[CHUNKS - 1] = 0 (carry has CHUNKS rows)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < DN
    state = tl.zeros([BLOCK], dtype=tl.float32)
    # while, not range(CHUNKS): Triton 3.6's interpreter cannot take a kernel argument as a range bound
    if BACKWARD:
        tl.store(carry_ptr + (CHUNKS - 1) * DN + i, state, mask=mask)
        c = CHUNKS - 1
        while c > 0:
            state = tl.load(local_ptr + c * DN + i, mask=mask) + tl.load(decay_ptr + c * DN + i, mask=mask) * state
            tl.store(carry_ptr + (c - 1) * DN + i, state, mask=mask)
            c -= 1
    else:
        tl.store(carry_ptr + i, state, mask=mask)
        c = 0
        while c < CHUNKS:
            state = tl.load(decay_ptr + c * DN + i, mask=mask) * state + tl.load(local_ptr + c * DN + i, mask=mask)
            c += 1
            tl.store(carry_ptr + c * DN + i, state, mask=mask)


@triton.jit
def _chunk_forward(
    x_ptr, dt_ptr, bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, reset_ptr, start_ptr, y_ptr,
    T, D, stride_x, stride_dt, stride_b, stride_c, stride_z, stride_y,
    N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    c, pd = tl.program_id(0), tl.program_id(1)
    t = c * CHUNK + tl.arange(0, CHUNK)
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    in_t, in_d = t < T, d < D
    mask = in_t[:, None] & in_d[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = tl.where(mask, _softplus(_load_dt(dt_ptr, bias_ptr, t, d, mask, stride_dt, D)), 0.0)
    keep = (tl.load(reset_ptr + t, mask=in_t, other=0) == 0)[:, None]
    dtx = dt * x
    y = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    for n in range(N):
        a_n = tl.load(a_ptr + d * N + n, mask=in_d, other=0.0)
        b_n = tl.load(b_ptr + t * stride_b + n, mask=in_t, other=0.0).to(tl.float32)
        c_n = tl.load(c_ptr + t * stride_c + n, mask=in_t, other=0.0).to(tl.float32)
        h0 = tl.load(start_ptr + (c * D + d) * N + n, mask=in_d, other=0.0)
        a = tl.where(keep, tl.exp(dt * a_n[None, :]), 0.0)
        decay, h = tl.associative_scan((a, dtx * b_n[:, None]), 0, _combine)
        y += (h + decay * h0[None, :]) * c_n[:, None]
    z = tl.load(z_ptr + t[:, None] * stride_z + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y += x * tl.load(d_ptr + d, mask=in_d, other=0.0)[None, :]
    y *= z * tl.sigmoid(z)
    tl.store(y_ptr + t[:, None] * stride_y + d[None, :], y, mask=mask)


@triton.jit
def _chunk_backward(
    x_ptr, dt_ptr, bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, reset_ptr, start_ptr, adjoint_ptr, dout_ptr,
    dx_ptr, ddt_ptr, dz_ptr, db_ptr, dc_ptr, da_ptr, dd_ptr, dbias_ptr,
    T, D, stride_x, stride_dt, stride_b, stride_c, stride_z, stride_dout,
    N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Every gradient of one chunk and channel block; dx, d(dt_raw), dz: [T, D] in the inputs' dtypes.
    Partial sums: db, dc [channel blocks, T, N]; da [chunks, D, N]; dd, dbias [chunks, D] (float32)."""
    c, pd = tl.program_id(0), tl.program_id(1)
    local = tl.arange(0, CHUNK)
    t = c * CHUNK + local
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    in_t, in_d = t < T, d < D
    mask = in_t[:, None] & in_d[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dt_in = _load_dt(dt_ptr, bias_ptr, t, d, mask, stride_dt, D)
    dt = tl.where(mask, _softplus(dt_in), 0.0)
    keep = (tl.load(reset_ptr + t, mask=in_t, other=0) == 0)[:, None]
    # a_{t+1} inside the chunk (the next chunk's first a is in the carried adjoint)
    nxt = t + 1
    next_mask = (in_t & (local < CHUNK - 1) & (nxt < T))[:, None] & in_d[None, :]
    dt_next = tl.where(next_mask, _softplus(_load_dt(dt_ptr, bias_ptr, nxt, d, next_mask, stride_dt, D)), 0.0)
    keep_next = (tl.load(reset_ptr + nxt, mask=in_t & (nxt < T), other=0) == 0)[:, None]
    z = tl.load(z_ptr + t[:, None] * stride_z + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + t[:, None] * stride_dout + d[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = z * tl.sigmoid(z)
    dy = dout * gate
    dtx = dt * x
    last = (local == CHUNK - 1)[:, None]
    y = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    dx = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    ddt = tl.zeros([CHUNK, BLOCK_D], dtype=tl.float32)
    for n in range(N):
        a_n = tl.load(a_ptr + d * N + n, mask=in_d, other=0.0)
        b_n = tl.load(b_ptr + t * stride_b + n, mask=in_t, other=0.0).to(tl.float32)
        c_n = tl.load(c_ptr + t * stride_c + n, mask=in_t, other=0.0).to(tl.float32)
        offset = (c * D + d) * N + n
        h0 = tl.load(start_ptr + offset, mask=in_d, other=0.0)
        g_end = tl.load(adjoint_ptr + offset, mask=in_d, other=0.0)
        a = tl.where(keep, tl.exp(dt * a_n[None, :]), 0.0)
        b = dtx * b_n[:, None]
        decay, h = tl.associative_scan((a, b), 0, _combine)
        h += decay * h0[None, :]
        a_next = tl.where(last, 1.0, tl.where(keep_next, tl.exp(dt_next * a_n[None, :]), 0.0))
        reach, g = tl.associative_scan((a_next, dy * c_n[:, None]), 0, _combine, reverse=True)
        g += reach * g_end[None, :]
        y += h * c_n[:, None]
        before = h - b  # a_t h_{t-1}
        dx += g * dt * b_n[:, None]
        ddt += g * (a_n[None, :] * before + x * b_n[:, None])
        tl.store(da_ptr + offset, tl.sum(g * dt * before, axis=0), mask=in_d)
        tl.store(db_ptr + (pd * T + t) * N + n, tl.sum(g * dtx, axis=1), mask=in_t)
        tl.store(dc_ptr + (pd * T + t) * N + n, tl.sum(h * dy, axis=1), mask=in_t)
    d_skip = tl.load(d_ptr + d, mask=in_d, other=0.0)
    y += x * d_skip[None, :]
    sig = tl.sigmoid(z)
    dz = dout * y * sig * (1.0 + z * (1.0 - sig))
    dx += dy * d_skip[None, :]
    ddt = tl.where(mask, ddt * tl.sigmoid(dt_in), 0.0)
    tl.store(dx_ptr + t[:, None] * D + d[None, :], dx, mask=mask)
    tl.store(ddt_ptr + t[:, None] * D + d[None, :], ddt, mask=mask)
    tl.store(dz_ptr + t[:, None] * D + d[None, :], dz, mask=mask)
    tl.store(dd_ptr + c * D + d, tl.sum(dy * x, axis=0), mask=in_d)
    tl.store(dbias_ptr + c * D + d, tl.sum(ddt, axis=0), mask=in_d)
