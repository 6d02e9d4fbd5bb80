"""One capability record per model type: everything flame knows about training it, in one place.

Every check and table that depends on the model type reads these records:
- how it takes packed documents (flame.models.inputs; the build warning in flame.models.builder),
- whether it compiles, the dtypes, device and packages its kernels need (flame.prepare.model),
- its tensor-parallel plan, by name (the plans are in flame.distributed.tensor_parallel),
- whether and how it runs context parallel (flame.distributed.context_parallel),
- which of its layers FLOPs count as softmax attention (flame.models.flops),
- measured gradient spikes it warns about (flame.models.builder),
- the layers that call flash-attn, and whether llama's architecture expresses it: the HF export's format
  (flame.checkpoint.llama_export.choose),
- the support table: ``python -m flame.models`` (``--markdown``: docs/models.md's, flame.models.support_table).

A learned position table (GPT-2's ``wpe``, fla's ``cat``) is not recorded: preflight finds it in
the model itself, so it covers any HF model. A model type without a record (any other
transformers causal LM, a custom model) gets ``GENERIC``: flame's document attention, no TP
plan, no context parallelism.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from transformers import PretrainedConfig

from flame.compat import mamba_ssm
from flame.models.registry import fla_model_types


class Documents(Enum):
    """How a model type takes a batch of rows of packed documents."""

    ATTENTION = "flame's document attention"  # HF: position ids restart per document; attention masks by cu_seqlens
    CU_SEQLENS = "cu_seqlens over one row"  # fla: the batch flattened into one row, documents as cu_seqlens
    ROWS_WHOLE = "rows whole"  # each row one sequence: the model's state crosses its documents


class ContextParallelism(Enum):
    """How a model type's token mixers see the tokens of other context-parallel ranks."""

    NONE = "no"
    ATTENTION = "softmax attention"  # K/V all-gathered over the CP ranks (flame.models.kernels.attention)
    FLA_KERNELS = "fla's CP kernels"  # the recurrent state passed between ranks (NVIDIA GPUs)


@dataclass(frozen=True)
class Package:
    """A package a model type (or one of its config options) needs and fla does not install."""

    module: str  # its import name
    install: str  # the command that installs it
    purpose: str  # what the model needs it for
    option: str | None = None  # the config option that needs it; None: the model type itself


@dataclass(frozen=True)
class FlashAttnCaller:
    """A layer of a model type that calls flash-attn (as fla wrote it): without flash-attn it refuses to build or to
    run, unless flame.register() has put PyTorch's attention in its place (flame.compat.fla)."""

    layer: str  # the fla layer (or the kernel it runs)
    option: str | None = None  # the config setting that brings it in; None: every model of the type
    applies: Callable[[PretrainedConfig], bool] = lambda config: True  # whether ``config`` has it


def _set(option: str) -> Callable[[PretrainedConfig], bool]:
    return lambda config: bool(getattr(config, option, None))


@dataclass(frozen=True)
class GradientSpikes:
    """Measured gradient spikes under one setting of ``attn_mode``, warned about at build on GPUs."""

    attn_mode: str
    cause: str
    remedy: str


@dataclass(frozen=True)
class ModelSupport:
    """What flame knows about training one model type."""

    model_type: str
    library: str  # "transformers", "fla" or "custom_models"
    family: str  # the kind of token mixer
    documents: Documents = Documents.ATTENTION
    not_isolated_because: str = ""  # ROWS_WHOLE: why its documents cannot be kept apart
    compile_fails: str | None = None  # why torch.compile fails on its blocks; None: it compiles
    # why its compiled blocks train slower than eager (measured, or fla's default: FLA_COMPILED_SLOWER)
    compile_slower: str | None = None
    tensor_parallel_plan: str | None = None  # its plan's name in flame.distributed.tensor_parallel.PLANS
    context_parallel: ContextParallelism = ContextParallelism.NONE
    float32_refused_by: str | None = None  # the kernel that asserts its inputs are not float32
    cuda_only: str | None = None  # why it runs on CUDA GPUs only
    packages: tuple[Package, ...] = ()
    gradient_spikes: GradientSpikes | None = None
    softmax_layers: tuple[str, ...] = ()  # its fla layer classes that compute softmax attention (quadratic FLOPs)
    # its backward runs fla's gated chunk kernel, which fla runs on Hopper only through TileLang with
    # the pinned Triton (Triton 3.4 to 3.7.0 computes it wrong there, fla issue #640)
    tilelang_on_hopper: bool = False
    flash_attn_callers: tuple[FlashAttnCaller, ...] = ()  # its export loads without flame only with flash-attn
    exports_as_llama: bool = False  # llama's architecture computes it too (flame.checkpoint.llama_export)
    notes: str = ""

    @property
    def stays_eager(self) -> str | None:
        """Why --training.compile leaves its decoder blocks eager (they fail to compile, or trained slower compiled),
        said in the log; None: they are compiled. The flag helps or does nothing: a job file that compiles (the
        standard run's) trains every type."""
        return f"they do not compile: {self.compile_fails}" if self.compile_fails else self.compile_slower

    @property
    def name(self) -> str:
        """How messages name it: fla's types as "fla's <type>"."""
        return f"fla's {self.model_type}" if self.library == "fla" else self.model_type

    @property
    def honours_padding(self) -> bool:
        """Whether its models give each sequence of a padded batch (an attention mask) the results it
        gets alone. fla's layers unpad a masked batch into cu_seqlens, which the ROWS_WHOLE types
        ignore or refuse; transformers' models and flame's custom ones honour the mask. flame.eval
        scores the other types one sequence at a time."""
        return self.documents is not Documents.ROWS_WHOLE

    def package(self, module: str) -> Package:
        """Its package imported as ``module``."""
        return next(package for package in self.packages if package.module == module)

    def packages_needed(self, config: PretrainedConfig) -> list[Package]:
        """The packages this config needs: the type's own, and those of the options it sets."""
        return [p for p in self.packages if p.option is None or getattr(config, p.option, False)]

    def flash_attn_needed(self, config: PretrainedConfig) -> list[FlashAttnCaller]:
        """The layers of this config's model that call flash-attn."""
        return [caller for caller in self.flash_attn_callers if caller.applies(config)]


# Every fla type measured at 340M trained slower with its blocks compiled (docs/performance.md): fla runs
# its token mixers outside the compiled graph and its norms and SwiGLU are Triton kernels already, so
# inductor has little to fuse, and the graph's pieces cost host time every step. So --training.compile
# leaves every fla type's blocks eager (the measured types say so).
FLA_COMPILED_SLOWER = ("fla's token mixers run outside the compiled graph, and every fla type measured "
                       "(docs/performance.md) trained slower compiled")
# fla's hybrids: the layers a model config's ``attn`` lists are fla's softmax Attention
_HYBRID_ATTENTION = FlashAttnCaller("Attention", "attn", _set("attn"))
_FLA_DEFAULTS = {
    "documents": Documents.CU_SEQLENS,
    "cuda_only": "runs fla's Triton kernels (its norms, activations and token mixer)",
    "compile_slower": FLA_COMPILED_SLOWER,
}
_HYBRID = {"flash_attn_callers": (_HYBRID_ATTENTION,)}  # the types whose model config takes ``attn``


def _fla(model_type: str, family: str, **fields) -> ModelSupport:
    if fields.get("compile_fails"):  # fla's default "compiles, but slower" does not apply
        fields["compile_slower"] = None
    if fields.get("tilelang_on_hopper"):
        fields["notes"] = "; ".join(filter(None, (fields.get("notes"), _TILELANG_ON_HOPPER)))
    return ModelSupport(model_type, "fla", family, **{**_FLA_DEFAULTS, **fields})


def _rows_whole(why: str) -> dict:
    return {"documents": Documents.ROWS_WHOLE, "not_isolated_because": why}


SOFTMAX, SPARSE, LINEAR, SSM, HYBRID = "softmax attention", "sparse attention", "linear attention", "state space", "hybrid"
_ATTENTION_CP = {"context_parallel": ContextParallelism.ATTENTION}
_HF_DECODER = {"tensor_parallel_plan": "hf_decoder", **_ATTENTION_CP}
# transformers' MoE types: flame.models.moe (any transformers type whose config names experts and top_k is treated so)
_MOE = {"notes": "mixture of experts: the experts as one grouped GEMM (flame.models.experts), expert parallelism, "
        "the router's load-balancing loss in the loss, expert-load metrics; no tensor, context or pipeline parallelism"}
# DeepSeek-V3-style routers: a selection bias instead of a load-balancing loss (--training.router_bias_rate)
_BIASED_MOE = {"notes": "mixture of experts with shared experts: the experts as one grouped GEMM (flame.models.experts), "
               "expert parallelism, balanced by the routers' selection bias (--training.router_bias_rate), expert-load "
               "metrics; no tensor, context or pipeline parallelism"}


def _hf_hybrid(model_type: str, layers: str, kernels: str, moe: bool = False, **fields) -> ModelSupport:
    """A transformers hybrid: flame's attention, and its ``layers`` keep documents apart (flame.models.hybrid)."""
    notes = [f"its {layers} layers keep packed documents apart (flame.models.hybrid): on GPUs over the flattened "
             f"batch on {kernels}, elsewhere once per document"]
    if moe:
        notes.append(_MOE["notes"])
    if fields.get("tilelang_on_hopper"):
        notes.append(_TILELANG_ON_HOPPER)
    return ModelSupport(model_type, "transformers", HYBRID, notes="; ".join(notes), **fields)


_CONV_KERNEL = "fla's varlen causal_conv1d"
_GATED_DELTA_NET = ("Gated DeltaNet", f"{_CONV_KERNEL} and chunk_gated_delta_rule")
_MAMBA2_KERNELS = f"{_CONV_KERNEL} and mamba_ssm's SSD scan (fla's simple GLA without mamba_ssm)"
_MEASURED = "packed and separate documents differ (measured, docs/models-verified.md)"
_TILELANG_ON_HOPPER = "on Hopper GPUs fla runs its backward only with TileLang (3rdparty/install.sh installs it on GPU machines; pip install flame[gpu])"
# flame.compat.fla_mamba: its Mamba layers take flame's selective scan, which restarts at every document
_MAMBA_SCAN = "its Mamba layers run flame's selective scan (Triton); decoding with a cache runs fla's, token by token"
# the 340M config, one 32K-token varlen row (docs/perf-log.md, 2026-11-25, 2026-11-27 and 2026-11-28)
_COMPILED_SLOWER = "its compiled blocks trained 340M slower than eager (measured: docs/performance.md)"
_MAMBA_SSM = Package("mamba_ssm", mamba_ssm.INSTALL, "mamba_ssm's Mamba-3 scan kernels")
_TILELANG = Package("tilelang", "pip install tilelang", "the Mamba-3 MIMO kernels, written in TileLang", "is_mimo")
# (moba's calls to flash-attn need no package: flame provides them, flame.models.kernels.flash_attn_internals)
_FLASH_MOBA = Package("flash_moba", "pip install flash-moba", "FlashMoBA's fused kernel", "use_flash_moba")
# gla's gradient is ill-conditioned at each document's first token: the output there is (q.k) v, which
# the per-head output norm divides by |q.k|; how large a step's gradient comes out then depends on the
# kernels' rounding, and fla's chunk kernels round it far from fused_recurrent's (docs/models-verified.md)
_GLA_SPIKES = GradientSpikes(
    "chunk",
    "its gradient is ill-conditioned at each document's first token, and the chunk kernels can make a step's "
    "gradient norm hundreds of times the one fused_recurrent gives on the same weights and batch",
    'gradient clipping bounds such steps, and "attn_mode": "fused_recurrent" in the model config makes them '
    "rarer and smaller at ~1/2.7 the speed",
)

_RECORDS = (
    ModelSupport("llama", "transformers", SOFTMAX, **_HF_DECODER),
    ModelSupport("mistral", "transformers", SOFTMAX, **_HF_DECODER),
    ModelSupport("qwen2", "transformers", SOFTMAX, **_HF_DECODER),
    ModelSupport("qwen3", "transformers", SOFTMAX, **_HF_DECODER),
    ModelSupport("qwen3_moe", "transformers", SOFTMAX, **_MOE),
    ModelSupport("qwen2_moe", "transformers", SOFTMAX, **_MOE),
    ModelSupport("olmoe", "transformers", SOFTMAX, **_MOE),
    ModelSupport("mixtral", "transformers", SOFTMAX, **_MOE),
    ModelSupport("glm4_moe", "transformers", SOFTMAX, **_BIASED_MOE),
    # its text model (qwen3_5_text) is what AutoModelForCausalLM builds from a qwen3_5 config
    _hf_hybrid("qwen3_5", *_GATED_DELTA_NET, tilelang_on_hopper=True),
    _hf_hybrid("qwen3_5_text", *_GATED_DELTA_NET, tilelang_on_hopper=True),
    _hf_hybrid("qwen3_next", *_GATED_DELTA_NET, moe=True, tilelang_on_hopper=True),
    _hf_hybrid("olmo_hybrid", *_GATED_DELTA_NET, tilelang_on_hopper=True),
    _hf_hybrid("kimi_linear", "Kimi Delta Attention", f"{_CONV_KERNEL} and chunk_kda", moe=True),
    _hf_hybrid("nemotron_h", "Mamba-2", _MAMBA2_KERNELS),
    _hf_hybrid("falcon_h1", "Mamba-2", _MAMBA2_KERNELS),
    _hf_hybrid("granitemoehybrid", "Mamba-2", _MAMBA2_KERNELS, moe=True),
    _hf_hybrid("bamba", "Mamba-2", _MAMBA2_KERNELS),
    _hf_hybrid("jamba", "Mamba", f"{_CONV_KERNEL} and flame's selective scan", moe=True),
    _hf_hybrid("lfm2", "short convolution", _CONV_KERNEL),
    ModelSupport("gpt2", "transformers", SOFTMAX,
                 notes="learned position table: documents of at most max_position_embeddings tokens"),
    ModelSupport("flame_example_lm", "custom_models", SOFTMAX, tensor_parallel_plan="example_lm", **_ATTENTION_CP,
                 notes="custom_models/example_lm, the template for your own architecture"),
    _fla("abc", LINEAR, **_HYBRID, **_rows_whole("its layers refuse cu_seqlens")),
    _fla("bitnet", SOFTMAX, softmax_layers=("BitAttention",), flash_attn_callers=(FlashAttnCaller("BitAttention"),)),
    _fla("cat", SOFTMAX, **_rows_whole("its layers refuse cu_seqlens"),
         notes="learned position table: rows of at most max_position_embeddings tokens"),
    _fla("comba", LINEAR, **_HYBRID, tilelang_on_hopper=True),
    _fla("cyclic_flow_attention", LINEAR,
         **_rows_whole("its varlen backward gives other gradients than separate documents (measured, docs/models-verified.md)")),
    _fla("delta_net", LINEAR, **_HYBRID, tensor_parallel_plan="delta_net", float32_refused_by="chunk_delta_rule",
         compile_slower=_COMPILED_SLOWER),
    _fla("deltaformer", SOFTMAX, flash_attn_callers=(FlashAttnCaller("parallel_deltaformer"),),
         compile_fails="Triton cannot compile fla's parallel_deltaformer_fwd_kernel as inductor calls it"),
    _fla("forgetting_transformer", SOFTMAX, softmax_layers=("ForgettingAttention",)),
    _fla("gated_deltanet", LINEAR, **_HYBRID, tensor_parallel_plan="gated_deltanet",
         context_parallel=ContextParallelism.FLA_KERNELS, tilelang_on_hopper=True,
         compile_slower=_COMPILED_SLOWER),
    _fla("gated_deltaproduct", LINEAR, **_HYBRID, float32_refused_by="chunk_gated_delta_product"),
    _fla("gla", LINEAR, **_HYBRID, tensor_parallel_plan="gla", gradient_spikes=_GLA_SPIKES,
         compile_slower=_COMPILED_SLOWER),
    _fla("gsa", LINEAR, **_HYBRID, tensor_parallel_plan="gsa"),
    _fla("hgrn", LINEAR, **_HYBRID),
    _fla("hgrn2", LINEAR, **_HYBRID, compile_slower=_COMPILED_SLOWER),
    _fla("kda", LINEAR, **_HYBRID, context_parallel=ContextParallelism.FLA_KERNELS),
    _fla("lightnet", LINEAR, **_HYBRID),
    _fla("linear_attn", LINEAR, **_HYBRID, **_rows_whole(_MEASURED)),
    _fla("log_linear_mamba2", SSM, **_rows_whole("its layers ignore cu_seqlens; their chunk kernel refuses them")),
    _fla("mamba", SSM, notes=_MAMBA_SCAN),
    _fla("mamba2", SSM, tensor_parallel_plan="mamba2",
         compile_slower=_COMPILED_SLOWER,
         notes="trains on fla's Triton conv and mamba_ssm's Triton SSD scan with one group, else fla's GLA scan "
               "(flame.models.kernels.mamba2); tensor parallel with rmsnorm true"),
    _fla("mamba3", SSM, packages=(_MAMBA_SSM, _TILELANG)),
    _fla("mesa_net", LINEAR, **_HYBRID),
    _fla("mla", SOFTMAX, softmax_layers=("MultiheadLatentAttention",),
         flash_attn_callers=(FlashAttnCaller("MultiheadLatentAttention"),)),
    _fla("moba", SPARSE, packages=(_FLASH_MOBA,), flash_attn_callers=(FlashAttnCaller("MoBA"),)),
    _fla("mom", LINEAR, **_HYBRID, **_rows_whole(_MEASURED), tilelang_on_hopper=True),
    _fla("nsa", SPARSE, compile_fails="the compiled blocks give a NaN loss",
         flash_attn_callers=(FlashAttnCaller("parallel_nsa's sliding window", "window_size", _set("window_size")),)),
    _fla("parallax", LINEAR, compile_fails="inductor fails to compile fla's parallel_parallax_fwd_kernel"),
    _fla("path_attn", SOFTMAX, softmax_layers=("PaTHAttention",)),
    _fla("precond_gated_deltanet", LINEAR, **_HYBRID, tilelang_on_hopper=True),
    _fla("precond_kda", LINEAR, **_HYBRID),
    _fla("raven", LINEAR, **_HYBRID, **_rows_whole(_MEASURED)),
    _fla("retnet", LINEAR, **_HYBRID),
    _fla("rodimus", LINEAR, flash_attn_callers=(
        _HYBRID_ATTENTION, FlashAttnCaller("SlidingWindowSharedKeyAttention", "ska_attn", _set("ska_attn")))),
    _fla("rwkv6", LINEAR, **_HYBRID),
    _fla("rwkv7", LINEAR, **_HYBRID,
         compile_fails="inductor fails on an in-place op on a view returned by fla's custom autograd Function"),
    _fla("samba", HYBRID, **_HYBRID, softmax_layers=("Attention",), notes=_MAMBA_SCAN,
         compile_slower=_COMPILED_SLOWER),
    _fla("stickbreaking_attn", SOFTMAX, compile_fails="the compiled blocks give a NaN loss",
         softmax_layers=("StickBreakingAttention",)),
    # fla's Attention is also the softmax layer of the hybrids' attn layers
    _fla("transformer", SOFTMAX, tensor_parallel_plan="fla_transformer", softmax_layers=("Attention",),
         flash_attn_callers=(FlashAttnCaller("Attention"),), exports_as_llama=True,
         compile_slower=_COMPILED_SLOWER + (
             " (the graph breaks at fla's attention); at 1B 62k against 67k"), **_ATTENTION_CP),
    _fla("wall_transformer", SOFTMAX),
    _fla("yoco", HYBRID, tilelang_on_hopper=True, flash_attn_callers=(FlashAttnCaller(
        "Attention", "self_decoder_attn type swa", lambda config: config.self_decoder_attn.get("type") == "swa"),)),
)
RECORDS: dict[str, ModelSupport] = {record.model_type: record for record in _RECORDS}

# any other transformers causal LM, or a custom model; a model that cannot take flame's attention
# keeps its own (flame.models.builder warns)
GENERIC = ModelSupport(
    "*", "transformers", SOFTMAX,
    notes="one that cannot take flame's attention keeps its own, which does not reliably keep documents apart (warned)",
)
# an fla type without a record (an fla checkout newer than the records): fla's defaults
GENERIC_FLA = _fla("*", LINEAR, **_HYBRID)


def support_for(config_or_model_type: PretrainedConfig | str) -> ModelSupport:
    """The record of a model type (or of a config's), or the generic one for its library."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else config_or_model_type.model_type
    if model_type in RECORDS:
        return RECORDS[model_type]
    generic = GENERIC_FLA if model_type in fla_model_types() else GENERIC
    return dataclasses.replace(generic, model_type=model_type)


def model_types_where(condition: Callable[[ModelSupport], object]) -> list[str]:
    """The recorded model types whose record meets ``condition``, sorted (for messages)."""
    return sorted(model_type for model_type, record in RECORDS.items() if condition(record))


def softmax_attention_layers() -> set[str]:
    """The fla layer classes that compute softmax attention, over every record."""
    return {layer for record in RECORDS.values() for layer in record.softmax_layers}
