"""fla's seam: where flame changes flash-linear-attention's behaviour.

Written for fla-core 0.6.0 (3rdparty/requirements.txt). ``apply`` runs the changes every fla
model needs, once, right after flame imports fla (flame.models.registry.import_fla, their one
call site). Two more apply only to the runs that need them: ``kernels_take_cp_context``
(context parallelism, flame.distributed.context_parallel) and ``gsa_norm_gathers_heads``
(tensor parallelism, flame.distributed.tensor_parallel). mamba3's kernels from mamba_ssm:
flame.compat.mamba_ssm.
"""

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triton.runtime.autotuner import Autotuner

from flame.base import batch_context
from flame.compat.guard import Library, Target, patch

FLA = Library("fla", "fla-core", "0.6.0")


@dataclass(frozen=True)
class FlashAttn:
    """flame's stand-ins for the flash-attn functions fla's layers call (flame.models.kernels.attention and
    flame.models.kernels.flash_attn_internals hold them)."""

    flash_attn_func: Callable
    flash_attn_varlen_func: Callable
    varlen_forward: Callable  # flash-attn's internal _flash_attn_varlen_forward (fla's moba)
    varlen_backward: Callable  # ... and _flash_attn_varlen_backward


def gated_chunk_backward_refused() -> bool:
    """Whether fla refuses its Triton kernel for the gated chunk backward on this GPU.

    fla's ``chunk_bwd_dqkwg`` with a gate computes wrong gradients on Hopper with Triton 3.4 to
    3.7.0 (fla issue #640), so fla raises there unless TileLang's kernel replaces it (which it
    does for the gated delta rule family, not for simple GLA's float32 states). fla's own flags.
    """
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1


# fla modules that import flash-attn at module level -> the name fla sets to None without it
FLA_FLASH_ATTN_USERS = {
    "fla.layers.attn": "flash_attn_func",
    "fla.layers.bitattn": "flash_attn_func",
    "fla.layers.mla": "flash_attn_func",
    "fla.layers.rodimus": "flash_attn_func",
    "fla.ops.deltaformer.parallel": "flash_attn_func",
    "fla.ops.nsa.parallel": "flash_attn_func",
    "fla.layers.moba": "flash_attn_func",
    "fla.ops.moba.parallel": "flash_attn_varlen_func",
}
_MOBA_INTERNALS = ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


@patch(
    FLA,
    *(Target(FLA, module, name) for module, name in FLA_FLASH_ATTN_USERS.items()),
    *(Target(FLA, "fla.ops.moba.parallel", name) for name in _MOBA_INTERNALS),
)
def flash_attn_stand_ins(stand_ins: FlashAttn) -> None:
    """Give fla's softmax-attention layers flame's attention where flash-attn is not installed.

    Upstream: ``transformer``, ``samba``, the hybrids, ``moba`` and others call flash-attn's
    ``flash_attn_func``/``flash_attn_varlen_func`` (moba also its internal varlen forward and
    backward), imported at module level and None when flash-attn is missing; the layers then fail.
    flame: where they are None, those modules call flame's document attention, which has
    PyTorch's own kernels behind it (flash-attn builds only from source and no GPU image has
    it). Where flash-attn is installed, fla keeps it.
    """
    for module_name, name in FLA_FLASH_ATTN_USERS.items():
        module = importlib.import_module(module_name)
        if getattr(module, name) is None:
            module.flash_attn_func = stand_ins.flash_attn_func
            module.flash_attn_varlen_func = stand_ins.flash_attn_varlen_func
    moba = importlib.import_module("fla.ops.moba.parallel")
    if moba._flash_attn_varlen_forward is None:
        moba._flash_attn_varlen_forward = stand_ins.varlen_forward
        moba._flash_attn_varlen_backward = stand_ins.varlen_backward


# module -> the length arguments to drop from its autotuned kernels' keys
_KEYED_ON_LENGTH = {"fla.ops.deltaformer.parallel": ("C", "T")}


def _keyed_on(lengths: tuple[str, ...]) -> Callable[[object], bool]:
    return lambda module: any(
        isinstance(kernel, Autotuner) and any(key in lengths for key in kernel.keys) for kernel in vars(module).values()
    )


@patch(
    FLA,
    *(Target(FLA, module, holds=_keyed_on(lengths), shape=f"a module of autotuned kernels keyed on {' or '.join(lengths)}")
      for module, lengths in _KEYED_ON_LENGTH.items()),
)
def tune_once_per_shape() -> None:
    """Drop the document length from the autotuning keys of deltaformer's kernels.

    Upstream: Triton benchmarks every config of an autotuned kernel once per value of its key
    arguments; fla's deltaformer keys its kernels on the length of the chunk (``C``) or document
    (``T``) they run on, and its varlen path calls them document by document, so under packed
    documents each new length benchmarks 8-16 configs again: training stalls (docs/models-verified.md).
    flame: the kernels are tuned at the first length they see and keep that choice. The lengths
    are masked inside the kernels, so every config computes the same result.
    """
    for module_name, lengths in _KEYED_ON_LENGTH.items():
        for kernel in vars(importlib.import_module(module_name)).values():
            if isinstance(kernel, Autotuner) and any(key in lengths for key in kernel.keys):
                kernel.keys = [key for key in kernel.keys if key not in lengths]


def casting_level_scales(chunk_log_linear_attn: Callable) -> Callable:
    """``chunk_log_linear_attn`` taking its level scales in the queries' dtype."""

    @functools.wraps(chunk_log_linear_attn)
    def chunk(q, k, v, g, level_scales, *args, **kwargs):
        return chunk_log_linear_attn(q, k, v, g, level_scales.to(q.dtype), *args, **kwargs)

    chunk.casts_level_scales = True
    return chunk


_LOG_LINEAR_KERNEL = Target(FLA, "fla.layers.log_linear_mamba2", "chunk_log_linear_attn", ("q", "k", "v", "g", "level_scales"))


@patch(FLA, _LOG_LINEAR_KERNEL)
def level_scales_in_query_dtype() -> None:
    """Make log_linear_mamba2's layer call its chunk kernel with level scales in the queries' dtype.

    Upstream: the layer computes the level scales from a float32 weight, so under bf16 autocast
    (flame's one-GPU and DDP runs) they reach the kernel as float32 beside bf16 queries, and
    Triton refuses the kernel's ``tl.dot`` of the two (docs/models-verified.md).
    flame: casts them to the queries' dtype. Under FSDP's bf16 weights they are bf16 already:
    the cast gives autocast runs the same inputs.
    """
    layer = importlib.import_module(_LOG_LINEAR_KERNEL.module)
    layer.chunk_log_linear_attn = casting_level_scales(layer.chunk_log_linear_attn)


# fla layer module -> the function it calls, or the module class it builds, that runs outside
# torch.compile graphs (only that layer's name is replaced)
_RUN_EAGERLY = {"fla.layers.moba": "parallel_moba", "fla.layers.mamba3": "RMSNormGated"}


@patch(FLA, *(Target(FLA, module, name) for module, name in _RUN_EAGERLY.items()))
def outside_compiled_graphs() -> None:
    """Run moba's attention and mamba3's gated RMS norms eagerly inside compiled blocks.

    Upstream: compiled with its block, ``parallel_moba``'s gathers failed at the first compiled
    step with a device-side index assert in an inductor kernel; fla's ``RMSNormGated`` (mamba3)
    failed while tracing: dynamo made the norm's width symbolic (fla's ``input_guard`` wrapper is
    one code object shared by every kernel it wraps, so sizes seen there change between calls)
    and could not pass the ``num_warps`` computed from it to the Triton kernel (docs/models-verified.md).
    flame: the layers call that function, or build that module class, under
    ``torch.compiler.disable`` (a graph break per layer, as flame's own attention has); the
    blocks' projections, norms and MLPs still compile, and the loss curve is eager's.
    """
    for module_name, name in _RUN_EAGERLY.items():
        layer = importlib.import_module(module_name)
        original = getattr(layer, name)
        if isinstance(original, type):  # a module class: the layer's instances of it run eagerly
            eager = type(original.__name__, (original,), {"forward": torch.compiler.disable(original.forward)})
        else:
            eager = torch.compiler.disable(original)
        eager.runs_eagerly = True
        setattr(layer, name, eager)


# fla layer module -> the layer class whose constructor initializes its weights itself (``_initialize_weights``)
_CONSTRUCTOR_INITS = {"fla.layers.rwkv7": "RWKV7Attention", "fla.layers.rwkv6": "RWKV6Attention",
                      "fla.layers.mom": "MomAttention", "fla.layers.gated_deltaproduct": "GatedDeltaProduct"}


@patch(FLA, *(Target(FLA, module, f"{name}._initialize_weights", ("self", "module"))
              for module, name in _CONSTRUCTOR_INITS.items()))
def constructor_inits_skipped_on_meta() -> None:
    """Skip these layers' own weight init while they are built on the meta device.

    Upstream: each layer's constructor initializes its weights in Python; rwkv7's walks the hidden size element by
    element, and on the meta device (where flame builds every model, several times per run) that computes nothing
    and took 10 s a build of the 340M. flame: on meta tensors the init returns at once; the values come later,
    where the model is materialized (flame.models.constructor_init builds such blocks again for real).
    """
    for module_name, name in _CONSTRUCTOR_INITS.items():
        layer_class = getattr(importlib.import_module(module_name), name)
        original = layer_class._initialize_weights

        @functools.wraps(original)
        def initialize(self, module, _original=original):
            if any(parameter.is_meta for parameter in self.parameters(recurse=False)):
                return None
            return _original(self, module)

        layer_class._initialize_weights = initialize


class ChunkOffsets(torch.Tensor):
    """fla's chunk offsets of a batch's documents (a GPU tensor) whose last element, the chunk total, is known on
    the host: ``offsets[-1]`` is a CPU tensor of it, so fla's ``.item()`` on it does not wait for the GPU. Any other
    use is the plain tensor's (no ``__torch_function__``: ops return plain tensors, as for ``nn.Parameter``)."""

    host_total: int
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, index):
        if isinstance(index, int) and index == -1:
            return torch.tensor(self.host_total, dtype=self.dtype)
        return super().__getitem__(index)


def offsets_with_host_total(prepare_chunk_offsets: Callable) -> Callable:
    """``prepare_chunk_offsets`` returning ``ChunkOffsets`` for the active batch's ``cu_seqlens`` when the host has
    them (flame.base.batch_context)."""

    @functools.wraps(prepare_chunk_offsets)
    def prepare(cu_seqlens, chunk_size):
        offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
        if (total := batch_context.host_chunk_total(cu_seqlens, chunk_size)) is None:
            return offsets
        known = offsets.as_subclass(ChunkOffsets)
        known.host_total = total
        return known

    prepare.reads_host_total = True
    return prepare


# fla modules whose chunk functions size their outputs by ``prepare_chunk_offsets(cu_seqlens, size)[-1].item()``
_CHUNK_TOTAL_READERS = ("fla.ops.common.chunk_h", "fla.ops.mesa_net.chunk_h_fwd",
                        "fla.ops.path_attn.cumprod_householder_bwd")


@patch(FLA, *(Target(FLA, module, "prepare_chunk_offsets", ("cu_seqlens", "chunk_size"))
              for module in _CHUNK_TOTAL_READERS))
def chunk_totals_read_on_host() -> None:
    """Let fla's chunked state passes take the documents' chunk count from the host.

    Upstream: ``chunk_fwd_h`` and ``chunk_bwd_dh`` (gla, gsa, simple_gla, hgrn2's chunk path and others; mesa_net
    and path_attn alike) read the number of chunks over a packed row's documents from a GPU tensor
    (``split_offsets[-1].item()``) to size their outputs: the host waits for the GPU to drain, once per layer in the
    forward and twice in the backward, and the GPU then idles until the next launches come (22 ms of a gla 340M
    step of 257 ms on an H100, docs/perf-log.md). flame: the loader's batch keeps ``cu_seqlens`` as Python ints
    (flame.base.batch_context); for the active batch's own ``cu_seqlens`` the offsets carry their total computed
    from them, the same number. Any other ``cu_seqlens`` (a context-parallel share, a layer's own) reads it as fla does.
    """
    for module_name in _CHUNK_TOTAL_READERS:
        module = importlib.import_module(module_name)
        module.prepare_chunk_offsets = offsets_with_host_total(module.prepare_chunk_offsets)


def apply(flash_attn: FlashAttn) -> None:
    """The changes every fla model gets, right after fla's import (flame.models.registry.import_fla)."""
    flash_attn_stand_ins(flash_attn)
    tune_once_per_shape()
    level_scales_in_query_dtype()
    outside_compiled_graphs()
    constructor_inits_skipped_on_meta()
    chunk_totals_read_on_host()


def _takes(parameter: str) -> Callable[[Callable], bool]:
    return lambda function: parameter in inspect.signature(function).parameters


# fla layer modules -> the chunked kernel they call by that name, which takes fla's FLACPContext
CP_KERNEL_USERS = {"fla.layers.kda": "chunk_kda", "fla.layers.gated_deltanet": "chunk_gated_delta_rule"}


@patch(
    FLA,
    *(Target(FLA, module, name, holds=_takes("cp_context"), shape="a kernel taking cp_context")
      for module, name in CP_KERNEL_USERS.items()),
    Target(FLA, "fla.modules", "RotaryEmbedding.forward", ("self", "q", "k", "seqlen_offset", "cu_seqlens", "max_seqlen")),
    Target(FLA, "fla.modules", "ShortConvolution.forward", ("self", "x")),
)
def kernels_take_cp_context(wrap: Callable[[Callable], Callable]) -> None:
    """Let kda's and gated_deltanet's layers pass fla's context-parallel state between ranks.

    Upstream: fla's chunk kernels (and its rotary embeddings and short convolutions) run context
    parallel when given a ``cp_context`` (FLACPContext) for the batch, but the layers never pass
    one. flame: the layers call ``wrap(kernel)``, which adds the batch's ``cp_context`` under
    context parallelism (flame.distributed.context_parallel, which also wraps the model's rotary
    embeddings and short convolutions: their signatures are checked here). Both kernels run
    outside compiled graphs already; without a context-parallel batch the call is the kernel's.
    Applied to context-parallel runs of fla models only.
    """
    for module_name, name in CP_KERNEL_USERS.items():
        layer = importlib.import_module(module_name)
        setattr(layer, name, wrap(getattr(layer, name)))


_GSA_NORM_LINEAR = Target(FLA, "fla.layers.gsa", "rms_norm_linear", ("x", "norm_weight"))


@patch(FLA, _GSA_NORM_LINEAR)
def gsa_norm_gathers_heads(to_all_heads: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Let GSA's fused output norm and projection run on a tensor-parallel rank's heads.

    Upstream: GSA normalizes its output over all heads at once (g_norm spans value_dim) in one
    kernel fused with o_proj (``rms_norm_linear``). Under tensor parallelism a rank holds its
    heads of every token. flame: when the output is narrower than the norm (a rank's heads),
    ``to_all_heads`` first moves it from head shards to sequence shards (one all-to-all), so the
    replicated g_norm and o_proj run on this rank's tokens. Applied to tensor-parallel runs of gsa
    only (one TP mesh per process).
    """
    gsa = importlib.import_module(_GSA_NORM_LINEAR.module)
    original = gsa.rms_norm_linear

    @functools.wraps(original)
    def rms_norm_linear(x, norm_weight, *args, **kwargs):
        if x.shape[-1] != norm_weight.shape[-1]:  # this rank's heads of every token -> all heads of its tokens
            x = to_all_heads(x)
        return original(x, norm_weight, *args, **kwargs)

    gsa.rms_norm_linear = rms_norm_linear


def down_projections_called(model: torch.nn.Module, replaced: set[int]) -> None:
    """Make fla's gated MLPs call their down projection where it was replaced (``replaced``: ids of modules, e.g.
    a LoRA adapter, a float8 Linear).

    Upstream: fla's ``GatedMLP`` with ``fuse_swiglu`` hands ``down_proj.weight`` to its fused SwiGLU+Linear
    kernel and never calls ``down_proj``, so a module put in its place would not run (an adapter silently skipped,
    an FP8 layer computed in bf16). flame: there the fusion is off (SwiGLU, then ``down_proj`` itself)."""
    for module in model.modules():
        if getattr(module, "fuse_swiglu", False) and id(getattr(module, "down_proj", None)) in replaced:
            module.fuse_swiglu = False
