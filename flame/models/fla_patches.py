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
4. mamba3's kernels from a mamba_ssm built without its CUDA extensions. fla's mamba3 layer takes
   its scan from mamba_ssm (>= 2.3.2): Triton (SISO) or TileLang (MIMO) files. But
   ``mamba_ssm/__init__`` imports the compiled selective-scan extension, which Mamba-3 never
   calls, so a build without it (``MAMBA_SKIP_CUDA_BUILD=TRUE``: no nvcc, seconds instead of a
   long compile) fails to import and fla's layer finds no kernel. flame imports the kernel modules
   under a stand-in ``mamba_ssm`` package that skips that ``__init__`` (its subpackages' are
   empty), then removes the stand-in: ``import mamba_ssm`` fails afterwards as before, and
   fla's other layers keep the paths they chose at import.
5. mamba3 under activation checkpointing. mamba_ssm's Mamba-3 backward (SISO and MIMO) reads
   ``ctx.saved_tensors`` twice, once to check it is not empty; torch's checkpointing lets each
   saved tensor be unpacked once, so full and op-level AC failed in the first backward (H100,
   docs/models.md). flame hands that backward a context whose saved tensors were unpacked once.
6. mamba3's gated RMS norms outside torch.compile graphs. Compiled with its blocks, fla's
   ``RMSNormGated`` failed while tracing: dynamo made the norm's width symbolic (fla's
   ``input_guard`` wrapper is one code object shared by every kernel it wraps, so sizes seen
   there change between calls) and could not pass the ``num_warps`` computed from it to the
   Triton kernel (H100). Run eagerly, the compiled blocks give eager's loss curve with no
   recompilation.
"""

import functools
import importlib
import importlib.util
import sys

import torch

# module -> the length arguments to drop from its autotuned kernels' keys
_KEYED_ON_LENGTH = {"fla.ops.deltaformer.parallel": ("C", "T")}

# fla.layers.mamba3's names for the kernels it trains with -> (mamba_ssm module, name there)
MAMBA3_KERNELS = {
    "mamba3_siso_combined": ("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined"),
    "mamba3_mimo_combined": ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba3_mimo"),
}
# kernel name -> why it could not be imported from the installed mamba_ssm (preflight reports it)
mamba3_kernel_errors: dict[str, str] = {}

# fla layer module -> the function it calls, or the module class it builds, that runs outside
# torch.compile graphs (points 3 and 6 above; only that layer's name is replaced)
_RUN_EAGERLY = {"fla.layers.moba": "parallel_moba", "fla.layers.mamba3": "RMSNormGated"}


def apply() -> None:
    tune_once_per_shape()
    level_scales_in_query_dtype()
    outside_compiled_graphs()
    mamba3_kernels_from_mamba_ssm()


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


def outside_compiled_graphs() -> None:
    """Make the layers in ``_RUN_EAGERLY`` call those functions, or build those modules, eagerly."""
    for module_name, name in _RUN_EAGERLY.items():
        layer = _import(module_name)
        original = getattr(layer, name, None)
        if original is None or getattr(original, "runs_eagerly", False):
            continue
        if isinstance(original, type):  # a module class: the layer's instances of it run eagerly
            eager = type(original.__name__, (original,), {"forward": torch.compiler.disable(original.forward)})
        else:
            eager = torch.compiler.disable(original)
        eager.runs_eagerly = True
        setattr(layer, name, eager)


def mamba3_kernels_from_mamba_ssm() -> None:
    """Give fla's mamba3 layer the kernels an installed mamba_ssm has, even if it cannot be imported."""
    layer = _import("fla.layers.mamba3")
    package = importlib.util.find_spec("mamba_ssm")
    if layer is None or package is None:
        return  # no mamba_ssm: preflight refuses mamba3 with the install command
    missing = [name for name in MAMBA3_KERNELS if getattr(layer, name, None) is None]
    stand_in = "mamba_ssm" not in sys.modules and bool(missing)
    if stand_in:  # the package's module, its __init__ not run
        sys.modules["mamba_ssm"] = importlib.util.module_from_spec(package)
    try:
        for name in missing:
            module_name, kernel = MAMBA3_KERNELS[name]
            try:
                setattr(layer, name, getattr(importlib.import_module(module_name), kernel))
            except ImportError as error:  # no TileLang (MIMO), or a mamba_ssm older than Mamba-3
                mamba3_kernel_errors[name] = str(error)
    finally:
        if stand_in:
            del sys.modules["mamba_ssm"]
    layer.is_fast_path_available = layer.mamba3_siso_combined is not None
    for name in MAMBA3_KERNELS:
        kernel = getattr(layer, name, None)
        function = kernel.__globals__.get("_Mamba3Function") if kernel is not None else None
        if function is not None:
            unpack_saved_tensors_once(function)


class _SavedTensorsUnpackedOnce:
    """An autograd context whose ``saved_tensors`` were unpacked once; everything else is the context's."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def unpack_saved_tensors_once(function: type[torch.autograd.Function]) -> None:
    """Make ``function``'s backward see saved tensors unpacked once, however often it reads them."""
    backward = function.backward
    if getattr(backward, "unpacks_once", False):
        return

    def backward_unpacking_once(ctx, *grads):
        return backward(_SavedTensorsUnpackedOnce(ctx), *grads)

    backward_unpacking_once.unpacks_once = True
    function.backward = staticmethod(backward_unpacking_once)
