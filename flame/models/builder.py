"""Build any HF/fla causal LM from a config JSON, the way torchtitan's Trainer expects.

torchtitan builds ``model_cls(model_args)`` on the meta device, parallelizes it, moves it to
the device with ``to_empty`` and then calls ``model.init_weights(buffer_device=...)``. HF
models have an ``init_weights()`` of their own without that argument, so flame gives each
built model a subclass (same class name, so exports say e.g. ``LlamaForCausalLM``) whose
``init_weights`` re-runs the model's own HF initialization on the materialized weights —
parameters and non-persistent buffers such as rotary frequencies alike.
"""

import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torchtitan.protocols import BaseModelArgs
from torchtitan.tools.logging import logger
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from flame import device
from flame.components.loss import use_fused_cross_entropy
from flame.config_manager import ConfigError, fsdp_enabled
from flame.data.tokenizer import load_tokenizer
from flame.models import attention, fla_patches
from flame.models.context_parallel import check_context_parallel
from flame.models.flops import model_flops
from flame.models.inputs import (
    FLA_DOCUMENTS_NOT_ISOLATED,
    is_fla_config,
    keeps_rows_whole,
)
from flame.models.registry import ensure_model_type, meta_model
from flame.models.tensor_parallel import check_tensor_parallel


def load_model_config(path: str) -> PretrainedConfig:
    """The HF config at ``path`` (a config.json or a directory holding one)."""
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read model config {path}: {error}") from None
    model_type = config_dict.get("model_type")
    if model_type is None:
        raise ConfigError(f"model config {path} has no 'model_type'; add one (e.g. \"llama\")")
    ensure_model_type(model_type)  # imports fla for its types and unknown ones, so the list below has fla's
    if model_type not in CONFIG_MAPPING:
        known = ", ".join(sorted(CONFIG_MAPPING.keys()))
        raise ConfigError(
            f"unknown model_type '{model_type}' in {path}; custom architectures go under custom_models/. Known: {known}"
        )
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)  # as transformers loads a model directory
    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def check_vocabulary(config: PretrainedConfig, tokenizer_path: str) -> None:
    """The embedding must cover every id the tokenizer can produce, added tokens included."""
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ConfigError(
            f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
            f"({tokenizer_path}): set vocab_size >= {len(tokenizer)} (a multiple of 64) in the model config"
        )


# fla model types whose layers fail under torch.compile (measured, docs/models.md)
FLA_NOT_COMPILABLE = {
    "rwkv7": "inductor fails on an in-place op on a view returned by fla's custom autograd Function",
    "parallax": "inductor fails to compile fla's parallel_parallax_fwd_kernel",
    "nsa": "the compiled blocks give a NaN loss",
    "stickbreaking_attn": "the compiled blocks give a NaN loss",
    "deltaformer": "Triton cannot compile fla's parallel_deltaformer_fwd_kernel as inductor calls it",
}

# fla kernels measured to spike a model's gradients on GPUs: (model_type, attn_mode) -> the measurement.
# gla's gradient is ill-conditioned at each document's first token: the output there is (q.k) v,
# which the per-head output norm divides by |q.k| (scripts/bench/gradient_conditioning.py: on one
# GPU in fp32, a 1e-7 relative weight change moved the 340M gla's step-1 gradient norm by 31%, a
# transformer's gradients by 5e-6, and 99.9998% of gla's layer-0 dL/dq change sat on first tokens),
# so the kernels' rounding decides how large a step's gradient comes out.
FLA_GRADIENT_SPIKES = {
    ("gla", "chunk"): "its chunk kernels gave step-1 gradient norms of 5,227 and 13,424 where attn_mode "
    "fused_recurrent gave 6.8 and 6.3 (same weights, batch and loss; H200, fla 0.6; docs/perf-log.md, sessions 15-16)",
}


# fla model types, or their config options, whose layers call a package fla does not depend on:
# (model_type, option or None for the type itself) -> (import name, install command, what for).
# Without it fla fails after the processes started: mamba3 inside step 1, the options while building
# the model. (moba's flash-attn calls flame provides: flame.models.flash_attn_internals.)
FLA_NEEDS_PACKAGE = {
    # mamba_ssm's Triton files suffice (flame.models.fla_patches): no CUDA build, no dependencies
    ("mamba3", None): (
        "mamba_ssm",
        "MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps mamba-ssm",
        "mamba_ssm's Mamba-3 scan kernels",
    ),
    ("moba", "use_flash_moba"): ("flash_moba", "pip install flash-moba", "FlashMoBA's fused kernel"),
    ("mamba3", "is_mimo"): ("tilelang", "pip install tilelang", "the Mamba-3 MIMO kernels, written in TileLang"),
}


# fla model types whose chunk kernels assert that their inputs are not float32 (fla 0.6)
FLA_NEEDS_HALF_PRECISION = {"delta_net": "chunk_delta_rule", "gated_deltaproduct": "chunk_gated_delta_product"}


def float32_compute(job_config) -> str | None:
    """Why this job computes in float32 (a phrase), or None when it runs under bf16/fp16 mixed precision."""
    if not device.CUDA:
        return "CPU runs compute in float32"
    if job_config.training.mixed_precision_param == "float32":
        return "--training.mixed_precision_param float32"
    p = job_config.parallelism
    # torchtitan: FSDP casts the weights; without it, only a plain or DDP run gets autocast
    fsdp = fsdp_enabled(job_config, int(os.environ.get("WORLD_SIZE", "1")))
    if not fsdp and (p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1):
        return "tensor/pipeline parallelism without FSDP, where torchtitan applies no mixed precision"
    return None


def _has_learned_position_table(config: PretrainedConfig) -> bool:
    """Whether the model embeds absolute positions in a table (GPT-2's wpe, fla cat's pos_tokens).

    Built on the meta device: rotary and ALiBi models have no such table; a learned one is an
    nn.Embedding of max_position_embeddings rows (OPT's has 2 more) besides the token embeddings.
    """
    model = meta_model(config)
    rows = {config.max_position_embeddings, config.max_position_embeddings + 2}
    return any(
        isinstance(module, nn.Embedding) and module.num_embeddings in rows and module.num_embeddings != config.vocab_size
        for module in model.modules()
    )


def check_position_table(config: PretrainedConfig, job_config) -> None:
    """Refuse rows or documents longer than a learned position table: they fail in step 1 (a device assert on GPUs)."""
    t = job_config.training
    if keeps_rows_whole(config):
        longest, flag, spans = t.seq_len, "--training.seq_len", "rows (it takes no document boundaries, so it sees each row whole)"
    else:  # position ids restart at every document, and documents are cut at context_len
        longest, flag, spans = t.context_len, "--training.context_len", "documents"
    limit = getattr(config, "max_position_embeddings", None)
    if not limit or longest <= limit or not _has_learned_position_table(config):
        return
    raise ConfigError(
        f"{config.model_type} learns {limit} positions (max_position_embeddings in {job_config.model.config}), but this "
        f"job gives it {spans} of up to {longest} tokens; set {flag} to at most {limit}, or raise max_position_embeddings"
    )


def check_model_options(config: PretrainedConfig, job_config) -> None:
    """Refuse model settings flame cannot honour, before any expensive work."""
    model_type = config.model_type
    check_position_table(config, job_config)
    check_tensor_parallel(config, job_config)
    check_context_parallel(config, job_config)
    from flame.models.pipeline import (
        check_pipeline_parallel,  # pipeline imports this module's neighbours
    )

    check_pipeline_parallel(config, job_config)
    if job_config.compile.enable and model_type in FLA_NOT_COMPILABLE:
        raise ConfigError(
            f"--training.compile: fla's {model_type} does not compile ({FLA_NOT_COMPILABLE[model_type]}); train it without compile"
        )
    if model_type in FLA_NEEDS_HALF_PRECISION and (reason := float32_compute(job_config)):
        raise ConfigError(
            f"fla's {model_type} kernel ({FLA_NEEDS_HALF_PRECISION[model_type]}) refuses float32, but this job computes "
            f"in float32 ({reason}): train it on GPUs in bf16, with FSDP (--parallelism.data_parallel_shard_degree > 1) "
            "under tensor or pipeline parallelism"
        )
    if is_fla_config(config):
        # otherwise step 1 fails deep in Triton ("0 active drivers"); a seed checkpoint runs no kernel
        if not device.CUDA and not job_config.checkpoint.create_seed_checkpoint:
            raise ConfigError(
                f"fla's {model_type} runs fla's Triton kernels (its norms, activations and token mixer), which need a "
                "CUDA GPU; on a CPU machine train a transformers model (configs/llama_4M.json) or one from custom_models/"
            )
        for (needing_type, option), (module, install, purpose) in FLA_NEEDS_PACKAGE.items():
            if needing_type != model_type or (option and not getattr(config, option, False)):
                continue
            if importlib.util.find_spec(module) is None:
                subject = f"fla's {model_type} with {option} true" if option else f"fla's {model_type}"
                alternative = f", or set {option} to false in the model config" if option else ""
                raise ConfigError(f"{subject} needs {purpose}: {install} (not installed here){alternative}")
        if model_type == "mamba3":
            check_mamba3_kernels(config)
        return
    # HF attention settings that only flash-attn/eager kernels implement, not flame's attention
    if getattr(config, "attn_logit_softcapping", None):
        raise ConfigError(
            f"{model_type}: attn_logit_softcapping needs eager/flash-attn attention, which flame's document "
            "attention does not replace; set it to null in the model config"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ConfigError(
            f"{model_type}: attention_dropout {config.attention_dropout} is not supported by flame's document "
            "attention; set it to 0.0 in the model config"
        )


def check_mamba3_kernels(config: PretrainedConfig) -> None:
    """Refuse a mamba3 config that mamba_ssm's kernels here cannot run (flame.models.fla_patches loads them)."""
    if config.is_mimo:
        if config.chunk_size * config.mimo_rank > 64:  # mamba_ssm's Mamba3 module: "64/mimo_rank for MIMO"
            raise ConfigError(
                f"fla's mamba3 with is_mimo true: chunk_size {config.chunk_size} x mimo_rank {config.mimo_rank} "
                "needs more shared memory than a GPU has in mamba_ssm's MIMO kernels (410 KB at 64 x 4 on an "
                f"H100, which has 227 KB); set chunk_size to {max(64 // config.mimo_rank, 1)} in the model config"
            )
        if unmet := _unmet_requirement("mamba_ssm", "tilelang"):  # 0.1.15's compiler fails on them (H100)
            required, installed = unmet
            raise ConfigError(
                f"fla's mamba3 with is_mimo true runs mamba_ssm's TileLang kernels, written for {required}, not the "
                f"{installed} installed: pip install '{required}', or set is_mimo to false in the model config"
            )
    kernel = "mamba3_mimo_combined" if config.is_mimo else "mamba3_siso_combined"
    if error := fla_patches.mamba3_kernel_errors.get(kernel):
        install = FLA_NEEDS_PACKAGE[("mamba3", None)][1]
        raise ConfigError(
            f"fla's mamba3 found no {kernel} in the mamba_ssm installed here ({error}); mamba-ssm >= 2.3.2 "
            f"has the Mamba-3 kernels: {install} --upgrade"
        )


def _unmet_requirement(package: str, dependency: str) -> tuple[str, str] | None:
    """``package``'s requirement on ``dependency`` and the version installed, when that version does not meet it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requirements = [Requirement(line) for line in metadata.requires(package) or ()]
        installed = metadata.version(dependency)
    except metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        unconditional = requirement.name == dependency and requirement.marker is None
        if unconditional and not requirement.specifier.contains(installed, prereleases=True):
            return str(requirement), installed
    return None


class TorchtitanInit:
    """Mixin giving an HF model torchtitan's ``init_weights(buffer_device)``."""

    flame_init_seed: int | None = None  # the job's seed (debug.seed), set by build_model

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # a pipeline stage holds part of the model: it takes its part of a whole model's init
        if device.sharded_init_differs_from_full_init(self) or hasattr(self, "flame_stage"):
            self._init_from_full_copy()
        else:
            _reinitialize(self)

    def _init_from_full_copy(self) -> None:
        # Initialize an unsharded twin with the same RNG stream a single process would use,
        # then scatter it into this model's shards: every layout starts from the same weights.
        with torch.device("meta"):
            twin = self._hf_class(self.config)
        twin.to_empty(device="cpu")
        # from the job's seed, as a single process draws it (torchtitan seeds pipeline ranks apart)
        with torch.random.fork_rng(devices=[]):
            if self.flame_init_seed is not None:
                torch.manual_seed(self.flame_init_seed)
            _reinitialize(twin)
        own = dict(self.named_buffers())
        set_model_state_dict(self, twin.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
        for name, buffer in twin.named_buffers():
            if name in own:
                own[name].copy_(buffer)


def _reinitialize(model: nn.Module) -> None:
    # HF skips modules/tensors flagged as initialized; weights materialized by to_empty are not.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    for tensor in [*model.parameters(), *model.buffers()]:
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized
    hf_class = getattr(type(model), "_hf_class", type(model))
    with torch.no_grad():
        hf_class.init_weights(model)


@functools.cache
def _trainable_class(hf_class: type) -> type:
    attributes = {"__module__": hf_class.__module__, "_hf_class": hf_class}
    return type(hf_class.__name__, (TorchtitanInit, hf_class), attributes)


@dataclass
class FlameModelArgs(BaseModelArgs):
    """torchtitan model args for a model described by an HF config."""

    config_path: str = ""
    hf_config: dict[str, Any] = field(default_factory=dict)
    context_len: int = 0
    fused_cross_entropy: bool = False
    fused_cross_entropy_required: bool = False
    seed: int | None = None

    def update_from_config(self, job_config, **kwargs) -> None:
        self.config_path = job_config.model.config
        self.context_len = job_config.training.context_len
        self.seed = job_config.debug.seed
        config = load_model_config(self.config_path)
        check_vocabulary(config, job_config.model.tokenizer_path)
        check_model_options(config, job_config)
        self._config = config
        self.hf_config = config.to_diff_dict()
        attention.set_backend(job_config.model.attention)
        self.fused_cross_entropy = device.fused_cross_entropy_enabled(job_config, getattr(config, "vocab_size", 0))
        self.fused_cross_entropy_required = job_config.training.fused_cross_entropy == "on"

    @property
    def config(self) -> PretrainedConfig:
        return self._config

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and FLOPs per token for documents of context_len (the trainer counts real ones)."""
        unique = {id(p): p.numel() for p in model.parameters()}
        self.flops = model_flops(model)
        return sum(unique.values()), self.flops.flops_per_token(self.context_len)

    flops = None  # the ModelFlops, once get_nparams_and_flops has seen the model


def build_model(model_args: FlameModelArgs) -> nn.Module:
    """The causal LM for ``model_args`` (on whatever device/dtype context is active).

    HF models get flame's document-masked attention; a model that cannot take a registered
    attention function keeps its own (with a warning: documents may see each other).
    """
    config = model_args.config
    try:
        model = _from_config(config, model_args)
    except ValueError as error:
        raise ConfigError(f"cannot build a causal LM from {model_args.config_path}: {error}") from None
    model.__class__ = _trainable_class(type(model))
    model.flame_init_seed = model_args.seed
    if model_args.fused_cross_entropy:
        try:
            use_fused_cross_entropy(model)
        except ValueError as reason:
            if model_args.fused_cross_entropy_required:
                raise ConfigError(
                    f"--training.fused_cross_entropy on: {type(model).__name__} cannot use it ({reason}); set it to off"
                ) from None
            logger.info(f"Fused cross entropy off: {reason}")
    return model


def _from_config(config: PretrainedConfig, model_args: FlameModelArgs) -> nn.Module:
    if is_fla_config(config):
        if config.model_type in FLA_DOCUMENTS_NOT_ISOLATED:
            logger.warning(
                f"fla's {config.model_type} does not isolate packed documents ({FLA_DOCUMENTS_NOT_ISOLATED[config.model_type]}): "
                "its state crosses the documents of a row; use --training.no-varlen with short rows to limit it"
            )
        if device.CUDA:  # a run that seems stuck before step 1 is most often this
            logger.info(
                "fla's Triton kernels compile and autotune the first time each shape and dtype runs: on a new machine "
                "step 1 can take minutes; Triton caches both (~/.triton/cache; the choices with "
                "TRITON_CACHE_AUTOTUNING=1, train.sh's default), so later runs on this machine start sooner"
            )
            spikes = FLA_GRADIENT_SPIKES.get((config.model_type, getattr(config, "attn_mode", None)))
            if spikes:
                logger.warning(
                    f"fla's {config.model_type}: {spikes}; gradient clipping bounds such steps, and "
                    '"attn_mode": "fused_recurrent" in the model config makes them rarer and smaller '
                    "(at most 207 in 20 bf16 steps) at ~1/2.7 the speed"
                )
        return AutoModelForCausalLM.from_config(config)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention.HF_ATTENTION)
    except ValueError as error:
        if "attn_implementation" not in str(error) and "attention" not in str(error):
            raise
        logger.warning(
            f"{config.model_type} cannot use flame's attention ({error}); its own attention gets restarting "
            "position ids, which does not reliably keep packed documents apart (docs/models.md)"
        )
        return AutoModelForCausalLM.from_config(config)


class AnyFlavor(Mapping):
    """torchtitan looks model args up by flavor; flame has one, described by model.config."""

    def __getitem__(self, flavor: str) -> FlameModelArgs:
        return FlameModelArgs()

    def __iter__(self):
        return iter(["flame"])

    def __len__(self) -> int:
        return 1
