"""Where flame changes fla 0.6's behaviour, applied once when fla is imported (registry.import_fla).

1. Autotuning keys of fla kernels that would tune again for every document length.
   Triton benchmarks every config of an autotuned kernel once per value of its key arguments.
   fla's deltaformer keys its kernels on the length of the chunk (``C``) or document (``T``) they
   run on, and its varlen path calls them document by document: under packed documents each new
   length benchmarks 8-16 configs again, and the tiny deltaformer did not finish 12 training steps
   within 470 s on an H200 (docs/models.md). Without the length in the key a kernel is tuned at
   the first length it sees and keeps that choice; the lengths are masked inside the kernels, so
   every config computes the same result.
2. log_linear_mamba2's level scales in the queries' dtype. Its layer computes them from a float32
   weight, so under bf16 autocast (flame's one-GPU and DDP runs) they reach the chunk kernel as
   float32 beside bf16 queries, and Triton refuses the kernel's ``tl.dot`` of the two
   (docs/models.md). Under FSDP's bf16 weights they are bf16 already: the cast gives autocast
   runs the same inputs.
3. moba's attention outside torch.compile graphs. Compiled with its blocks, the gathers of fla's
   ``parallel_moba`` failed at the first compiled step with a device-side index assert in an
   inductor kernel (H100, docs/models.md). It now runs eagerly, as flame's own attention does (a
   graph break per layer); the block's projections, norms and MLP still compile.
"""

import functools
import importlib

import torch

# module -> the length arguments to drop from its autotuned kernels' keys
_KEYED_ON_LENGTH = {"fla.ops.deltaformer.parallel": ("C", "T")}


def apply() -> None:
    tune_once_per_shape()
    level_scales_in_query_dtype()
    moba_attention_eager()


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:  # another fla version (a 3rdparty/ checkout) may have moved or fixed it
        return None


def tune_once_per_shape() -> None:
    """Drop the length arguments from those kernels' autotune keys."""
    from triton.runtime.autotuner import Autotuner

    for module_name, lengths in _KEYED_ON_LENGTH.items():
        module = _import(module_name)
        for kernel in vars(module).values() if module else ():
            if isinstance(kernel, Autotuner) and any(key in lengths for key in kernel.keys):
                kernel.keys = [key for key in kernel.keys if key not in lengths]


def casting_level_scales(chunk_log_linear_attn):
    """``chunk_log_linear_attn`` taking its level scales in the queries' dtype."""

    @functools.wraps(chunk_log_linear_attn)
    def chunk(q, k, v, g, level_scales, *args, **kwargs):
        return chunk_log_linear_attn(q, k, v, g, level_scales.to(q.dtype), *args, **kwargs)

    chunk.casts_level_scales = True
    return chunk


def level_scales_in_query_dtype() -> None:
    """Make log_linear_mamba2's layer call the chunk kernel with level scales in the queries' dtype."""
    layer = _import("fla.layers.log_linear_mamba2")
    kernel = getattr(layer, "chunk_log_linear_attn", None)
    if kernel is not None and not getattr(kernel, "casts_level_scales", False):
        layer.chunk_log_linear_attn = casting_level_scales(kernel)


def moba_attention_eager() -> None:
    """Make moba's layer call ``parallel_moba`` outside compiled graphs."""
    layer = _import("fla.layers.moba")
    moba = getattr(layer, "parallel_moba", None)
    if moba is not None and not getattr(moba, "runs_eagerly", False):
        eager = torch.compiler.disable(moba)
        eager.runs_eagerly = True
        layer.parallel_moba = eager
