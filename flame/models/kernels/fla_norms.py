"""fla's RMSNorm, its residual add included, as one compiled function (--model.compiled_fla_norms), and its output
in the compute dtype (--model.fla_norms_in_compute_dtype).

fla's blocks call ``norm(hidden_states, residual, True)``: the residual added and the sum normalized in one Triton
kernel each way. The same computation compiled by inductor ran forward and backward in 0.78 ms where fla's took
1.05 at 32,768 x 1,024 in float32 (the residual stream of one GPU's autocast), and 0.66 against 0.80 in bf16 (FSDP's),
on an H100 (docs/perf-log.md, 2026-12-07): about 13 ms of a 340M step's 49 norms. Each module keeps its class,
parameters and names; the compiled function computes in float32 as fla's kernel does and returns what it returns
(the normalized sum in the input's dtype, the sum in the residual's).

--model.fla_norms_in_compute_dtype (either kernel): under autocast (one GPU) the normalized sum comes in autocast's
dtype. A block's first norm reads the float32 residual stream, so fla's kernel hands its output in float32, and each
projection reading it casts it on its own (gla: q, k, v, the gate's low-rank input and g, five casts; in the backward
five gradients cast back and summed in float32); cast once, the projections read it as it is, the same values. The
compiled function writes it in that dtype directly; fla's kernel's output is cast once. Consumers that are not
matmuls (rwkv7's token shift) then see it rounded to bf16, as they do under FSDP's bf16 weights.

Inside compiled blocks (--training.compile) and off CUDA the module runs fla's own code: inductor compiles the
block's norm itself, and fla's kernel needs a GPU anyway. Each row length compiles once (dynamic=False: a job's
micro-batches share one); the first runs add seconds to step 1.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from flame.models import registry

_RMS_NORM = ("fla.modules", "RMSNorm")  # fla's fused RMSNorm class; its subclasses (gated norms) compute more


def _add_and_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, eps: float, prenorm: bool, residual_in_fp32: bool,
                  normed_dtype: torch.dtype | None):
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    summed = x.float() if residual is None else x.float() + residual.float()
    normed = F.rms_norm(summed, (summed.shape[-1],), None if weight is None else weight.float(), eps)
    if bias is not None:
        normed = normed + bias.float()
    normed = normed.to(normed_dtype or x.dtype)
    return (normed, summed.to(residual_dtype)) if prenorm else normed


@functools.cache
def _compiled():
    # one graph per row length and per call form (with or without a residual, prenorm or not): a few per job
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    return torch.compile(_add_and_norm, dynamic=False)


def _forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return self.compiled_from.forward(self, x, residual, prenorm, residual_in_fp32)
    # autocast leaves fla's kernel alone (a custom Function); it must not recast this one either
    under_autocast = torch.is_autocast_enabled("cuda")
    normed_dtype = torch.get_autocast_dtype("cuda") if under_autocast and self.normed_in_compute_dtype else None
    with torch.autocast("cuda", enabled=False) if under_autocast else nullcontext():
        return _compiled()(x, residual, self.weight, self.bias, self.eps, prenorm, residual_in_fp32, normed_dtype)


def _casting_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    out = self.compiled_from.forward(self, x, residual, prenorm, residual_in_fp32)
    if not torch.is_autocast_enabled(x.device.type):
        return out
    dtype = torch.get_autocast_dtype(x.device.type)
    return (out[0].to(dtype), out[1]) if prenorm else out.to(dtype)


@functools.cache
def _swapped_class(original: type, compiled: bool) -> type:
    return type(original.__name__, (original,), {"__module__": original.__module__,
                                                 "forward": _forward if compiled else _casting_forward,
                                                 "compiled_from": original})


def swap_norms(model: nn.Module, compiled: bool, in_compute_dtype: bool) -> str:
    """Give ``model``'s fla RMSNorms the compiled forward (``compiled``), and under autocast their normed output in
    autocast's dtype (``in_compute_dtype``), before parallelizing; returns the log line."""
    registry.import_fla()
    rms_norm = getattr(importlib.import_module(_RMS_NORM[0]), _RMS_NORM[1])
    swapped = 0
    for module in model.modules():
        if type(module) is rms_norm:
            module.__class__ = _swapped_class(rms_norm, compiled)
            module.normed_in_compute_dtype = in_compute_dtype
            swapped += 1
    what = " and ".join(part for part, on in (
        ("--model.compiled_fla_norms: through one compiled function (residual add included)", compiled),
        ("--model.fla_norms_in_compute_dtype: their normed output in autocast's dtype", in_compute_dtype)) if on)
    return f"{swapped} of fla's RMSNorms, {what}" + ("" if swapped else ": the model has none")
