"""Build any HF/fla causal LM from a config JSON, the way torchtitan's Trainer expects.

torchtitan builds ``model_cls(model_args)`` on the meta device, parallelizes it, moves it to
the device with ``to_empty`` and then calls ``model.init_weights(buffer_device=...)``. HF
models have an ``init_weights()`` of their own without that argument, so flame gives each
built model a subclass (same class name, so exports say e.g. ``LlamaForCausalLM``) whose
``init_weights`` re-runs the model's own HF initialization on the materialized weights —
parameters and non-persistent buffers such as rotary frequencies alike.
"""

import functools
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
from transformers import AutoModelForCausalLM, PretrainedConfig

from flame.base import device
from flame.models.loss import use_fused_cross_entropy
from flame.base.errors import ConfigError
from flame.models.kernels import attention, fla_norms
from flame.models import constructor_init, experts, hybrid, lora, moe
from flame.models.flops import model_flops
from flame.models.kernels.fused import prepare_kernels, use_fused_kernels
from flame.models.inputs import is_fla_config
from flame.models.lora import LoraSettings
from flame.models.model_config import load_model_config
from flame.models.support import Documents, support_for


class TorchtitanInit:
    """Mixin giving an HF model torchtitan's ``init_weights(buffer_device)``."""

    init_seed: int | None = None  # the job's seed (debug.seed): each trainable class is made for one
    adapters: LoraSettings | None = None  # the LoRA adapters the model carries (a full copy needs them too)
    holds_part_of_model = False  # a pipeline stage does (flame.distributed.pipeline)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # a pipeline stage holds part of the model: it takes its part of a whole model's init
        if device.sharded_init_differs_from_full_init(self) or self.holds_part_of_model:
            self._init_from_full_copy()
        else:
            reinitialize(self)
        if buffer_device is not None:  # CPU offload: the weights live on the host, the buffers where the forward runs
            for module in self.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    module._buffers[name] = buffer.to(buffer_device)

    def _init_from_full_copy(self) -> None:
        # Initialize an unsharded twin with the same RNG stream a single process would use,
        # then scatter it into this model's shards: every layout starts from the same weights.
        with torch.device("meta"):
            twin = self._hf_class(self.config)
            if self.adapters is not None:
                lora.add_adapters(twin, self.adapters)
        twin.to_empty(device="cpu")
        # from the job's seed, as a single process draws it (torchtitan seeds pipeline ranks apart)
        with torch.random.fork_rng(devices=[]):
            if self.init_seed is not None:
                torch.manual_seed(self.init_seed)
            reinitialize(twin)
        own = dict(self.named_buffers())
        set_model_state_dict(self, twin.state_dict(), options=StateDictOptions(full_state_dict=True, strict=False))
        for name, buffer in twin.named_buffers():
            if name in own:
                own[name].copy_(buffer)


def reinitialize(model: nn.Module) -> None:
    """Run the model's own HF initialization on its weights and non-persistent buffers (after ``to_empty``)."""
    # HF skips modules/tensors flagged as initialized; weights materialized by to_empty are not.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    for tensor in [*model.parameters(), *model.buffers()]:
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized
    hf_class = getattr(type(model), "_hf_class", type(model))
    constructor_init.poison(model)  # what no init below writes stays NaN, and is found
    with torch.no_grad():
        hf_class.init_weights(model)
        lora.reset_adapters(model)  # HF's init gave their Linears its own
    constructor_init.repeat_constructor_init(model)  # what only the constructor sets (fla's rwkv7, samba, hgrn, ...)


@functools.cache
def _trainable_class(hf_class: type, init_seed: int | None, adapters: LoraSettings | None) -> type:
    attributes = {"__module__": hf_class.__module__, "_hf_class": hf_class, "init_seed": init_seed, "adapters": adapters}
    return type(hf_class.__name__, (TorchtitanInit, hf_class), attributes)


@dataclass
class FlameModelArgs(BaseModelArgs):
    """torchtitan model args for a model described by an HF config."""

    config_path: str = ""
    hf_config: dict[str, Any] = field(default_factory=dict)
    context_len: int = 0
    fused_cross_entropy: bool = False
    fused_cross_entropy_required: bool = False
    fused_kernels: bool = True
    compiled_fla_norms: bool = False
    fla_norms_in_compute_dtype: bool = False
    seed: int | None = None
    lora: LoraSettings | None = None

    def update_from_config(self, job_config, **kwargs) -> None:
        self.config_path = job_config.model.config
        self.context_len = job_config.training.context_len
        self.seed = job_config.debug.seed
        self.lora = LoraSettings.of(job_config.lora)
        config = load_model_config(self.config_path)  # checked before the Trainer (flame.prepare)
        self._config = config
        self.hf_config = config.to_diff_dict()
        attention.set_backend(job_config.model.attention)
        self.fused_cross_entropy = device.fused_cross_entropy_enabled(job_config, getattr(config, "vocab_size", 0))
        self.fused_cross_entropy_required = job_config.training.fused_cross_entropy == "on"
        self.fused_kernels = job_config.model.fused_kernels and not is_fla_config(config)  # fla's have theirs
        for flag in ("compiled_fla_norms", "fla_norms_in_compute_dtype"):
            if getattr(job_config.model, flag) and not is_fla_config(config):
                raise ConfigError(f"--model.{flag} changes fla's RMSNorms; {config.model_type} is a transformers "
                                  "model, whose norms --model.fused_kernels handles: drop the flag")
        self.compiled_fla_norms = job_config.model.compiled_fla_norms
        self.fla_norms_in_compute_dtype = job_config.model.fla_norms_in_compute_dtype
        if self.fused_kernels:
            prepare_kernels()

    @property
    def config(self) -> PretrainedConfig:
        return self._config

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and FLOPs per token for documents of context_len (the trainer counts real ones)."""
        unique = {id(p): p.numel() for p in model.parameters()}
        if self.lora is not None:
            logger.info(lora.describe(model, self.lora))
        self.flops = model_flops(model)
        return sum(unique.values()), self.flops.flops_per_token(self.context_len)

    flops = None  # the ModelFlops, once get_nparams_and_flops has seen the model


def build_model(model_args: FlameModelArgs) -> nn.Module:
    """The causal LM for ``model_args`` (on whatever device/dtype context is active).

    HF models get flame's document-masked attention; a model that cannot take a registered
    attention function keeps its own (with a warning: documents may see each other). A hybrid's
    recurrent and convolutional layers keep documents apart too (flame.models.hybrid). Their RMS
    norms, SiLU-gated MLPs and rotary embeddings get fused kernels (flame.models.kernels.fused). With
    --lora.rank, PEFT's LoRA adapters go on last, and everything else is frozen (flame.models.lora).
    """
    config = model_args.config
    try:
        model = _from_config(config, model_args)
    except ValueError as error:
        raise ConfigError(f"cannot build a causal LM from {model_args.config_path}: {error}") from None
    # torchtitan's init_weights(buffer_device) on HF's model: a subclass of the model's own class
    # (same name, so exports say e.g. LlamaForCausalLM), swapped in on the built instance
    model.__class__ = _trainable_class(type(model), model_args.seed, model_args.lora)
    # a hybrid's recurrent and conv layers: on GPUs over the flattened batch on varlen kernels, else once per document
    if not is_fla_config(config) and (kept := hybrid.keep_documents_apart(model, kernels=device.CUDA)):
        logger.info(kept)
    if moe.is_moe(model.config):
        moe.tap.attach(model)  # the routers' choices, for the load-balancing loss and the load metrics
        if layers := experts.use_flame_experts(model):  # (a hybrid's config may name experts its layers lack)
            logger.info(f"Experts of {layers} MoE layers: flame's grouped GEMM (flame.models.experts)")
    if model_args.fused_kernels and not is_fla_config(config):  # fla's models have theirs
        logger.info(use_fused_kernels(model).describe())
    if model_args.compiled_fla_norms or model_args.fla_norms_in_compute_dtype:
        logger.info(fla_norms.swap_norms(model, model_args.compiled_fla_norms, model_args.fla_norms_in_compute_dtype))
    if model_args.fused_cross_entropy:
        try:
            use_fused_cross_entropy(model)
        except ValueError as reason:
            if model_args.fused_cross_entropy_required:
                raise ConfigError(
                    f"--training.fused_cross_entropy on: {type(model).__name__} cannot use it ({reason}); set it to off"
                ) from None
            logger.info(f"Fused cross entropy off: {reason}")
    if model_args.lora is not None:  # last: the adapters wrap the Linears as the fused kernels left them
        lora.add_adapters(model, model_args.lora)
    return model


def _from_config(config: PretrainedConfig, model_args: FlameModelArgs) -> nn.Module:
    if is_fla_config(config):
        support = support_for(config)
        if support.documents is Documents.ROWS_WHOLE:
            logger.warning(
                f"{support.name} does not isolate packed documents ({support.not_isolated_because}): "
                "its state crosses the documents of a row; use --training.no-varlen with short rows to limit it"
            )
        if device.CUDA:  # a run that seems stuck before step 1 is most often this
            logger.info(
                "fla's Triton kernels compile and autotune the first time each shape and dtype runs: on a new machine "
                "step 1 can take minutes; Triton caches both (~/.triton/cache; the choices with "
                "TRITON_CACHE_AUTOTUNING=1, train.sh's default), so later runs on this machine start sooner"
            )
            spikes = support.gradient_spikes
            if spikes and getattr(config, "attn_mode", None) == spikes.attn_mode:
                logger.warning(f"{support.name} with attn_mode {spikes.attn_mode}: {spikes.cause}; {spikes.remedy}")
        return AutoModelForCausalLM.from_config(config)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention.HF_ATTENTION)
    except ValueError as error:
        if "attn_implementation" not in str(error) and "attention" not in str(error):
            raise
        logger.warning(
            f"{config.model_type} cannot use flame's attention ({error}); its own attention gets restarting "
            "position ids, which does not reliably keep packed documents apart (docs/models-verified.md)"
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
