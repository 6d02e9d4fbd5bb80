"""The job's model, checked before anything builds it: it fits the tokenizer, the options, the layout and
the packages installed here (what its capability record, flame.models.support, says).

The model config is read once and the meta model built once, when a check first needs it
(``ModelUnderCheck``); flame.prepare hands both to every check, and to the memory plan.
"""

import copy
import functools
import importlib.util
import os
from importlib import metadata

from packaging.requirements import Requirement
from torch import nn
from transformers import PretrainedConfig

from flame import compat
from flame.base import device
from flame.base.errors import ConfigError
from flame.checkpoint import llama_export
from flame.data.tokenizer import load_tokenizer
from flame.distributed.context_parallel import check_context_parallel
from flame.distributed.degrees import float32_compute
from flame.distributed.pipeline import check_pipeline_parallel
from flame.distributed.expert_parallel import check_expert_parallel
from flame.distributed.tensor_parallel import check_tensor_parallel
from flame.models import float8, init_from, lora, moe
from flame.models.inputs import keeps_rows_whole
from flame.models.model_config import load_model_config
from flame.models.registry import meta_model
from flame.optim.groups import check_rules_select
from flame.models.support import Documents, support_for


class ModelUnderCheck:
    """The job's model config, read once, and its model on the meta device, built once when first asked for."""

    def __init__(self, config: PretrainedConfig):
        self.config = config

    @classmethod
    def load(cls, config_path: str) -> "ModelUnderCheck":
        """The model of the config JSON at ``config_path`` (or of the directory holding it)."""
        return cls(load_model_config(config_path))

    @functools.cached_property
    def meta(self) -> nn.Module:
        """Modules, names and shapes, no memory; checks read it and change nothing in it."""
        return meta_model(self.config)

    def meta_copy(self) -> nn.Module:
        """A copy of the meta model for a check that adds to it (LoRA's adapters)."""
        return copy.deepcopy(self.meta)


def check_model(job_config, model: ModelUnderCheck) -> None:
    """Refuse a model that does not fit the tokenizer, the options or the layout, before any expensive work."""
    if job_config.model.init_from:  # checked on a resume too: the command names these weights
        init_from.check_fits(job_config.model.init_from, job_config.model.config, model.meta)
    check_vocabulary(model.config, job_config.model.tokenizer_path)
    check_model_options(model, job_config)


def check_vocabulary(config: PretrainedConfig, tokenizer_path: str) -> None:
    """The embedding must cover every id the tokenizer can produce, added tokens included."""
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ConfigError(
            f"model vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
            f"({tokenizer_path}): set vocab_size >= {len(tokenizer)} (a multiple of 64) in the model config"
        )


def _has_learned_position_table(config: PretrainedConfig, model: nn.Module) -> bool:
    """Whether the model embeds absolute positions in a table (GPT-2's wpe, fla cat's pos_tokens).

    Built on the meta device: rotary and ALiBi models have no such table; a learned one is an
    nn.Embedding of max_position_embeddings rows (OPT's has 2 more) besides the token embeddings.
    """
    rows = {config.max_position_embeddings, config.max_position_embeddings + 2}
    return any(
        isinstance(module, nn.Embedding) and module.num_embeddings in rows and module.num_embeddings != config.vocab_size
        for module in model.modules()
    )


def check_position_table(model: ModelUnderCheck, job_config) -> None:
    """Refuse rows or documents longer than a learned position table: they fail in step 1 (a device assert on GPUs)."""
    config, t = model.config, job_config.training
    if keeps_rows_whole(config):
        longest, flag, spans = t.seq_len, "--training.seq_len", "rows (it takes no document boundaries, so it sees each row whole)"
    else:  # position ids restart at every document, and documents are cut at context_len
        longest, flag, spans = t.context_len, "--training.context_len", "documents"
    limit = getattr(config, "max_position_embeddings", None)
    if not limit or longest <= limit or not _has_learned_position_table(config, model.meta):
        return
    raise ConfigError(
        f"{config.model_type} learns {limit} positions (max_position_embeddings in {job_config.model.config}), but this "
        f"job gives it {spans} of up to {longest} tokens; set {flag} to at most {limit}, or raise max_position_embeddings"
    )


def check_model_options(model: ModelUnderCheck, job_config) -> None:
    """Refuse model settings flame cannot honour, before any expensive work (what the model's record says)."""
    config = model.config
    support = support_for(config)
    check_position_table(model, job_config)
    check_checkpointed_blocks(config, job_config.activation_checkpoint)
    if job_config.training.logit_softcap and getattr(config, "final_logit_softcapping", None):
        raise ConfigError(f"--training.logit_softcap {job_config.training.logit_softcap:g}: {support.name} caps its "
                          f"logits itself (final_logit_softcapping {config.final_logit_softcapping:g} in its config): "
                          "drop the flag, or change the cap there")
    fused = device.fused_cross_entropy_enabled(job_config, getattr(config, "vocab_size", 0))
    if job_config.training.z_loss and job_config.parallelism.tensor_parallel_degree > 1 and not fused:
        raise ConfigError("--training.z_loss under tensor parallelism is computed inside the fused cross entropy, which "
                          "this run does not use: add --training.fused_cross_entropy on")
    check_tensor_parallel(config, job_config, lambda: model.meta)
    check_context_parallel(config, job_config)
    check_pipeline_parallel(config, job_config)
    check_expert_parallel(config, job_config)
    if job_config.training.router_bias_rate:
        moe.check_selection_bias(model.meta, job_config.training.router_bias_rate)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if support.float32_refused_by and (reason := float32_compute(job_config, world_size)):
        raise ConfigError(
            f"{support.name} kernel ({support.float32_refused_by}) refuses float32, but this job computes "
            f"in float32 ({reason}): train it on GPUs in bf16, with FSDP (--parallelism.data_parallel_shard_degree > 1) "
            "under tensor or pipeline parallelism"
        )
    # otherwise step 1 fails deep in Triton ("0 active drivers"); a seed checkpoint runs no kernel
    if support.cuda_only and not device.CUDA and not job_config.checkpoint.create_seed_checkpoint:
        raise ConfigError(
            f"{support.name} {support.cuda_only}, which need a CUDA GPU; on a CPU machine train a transformers "
            "model (configs/llama_4M.json) or one from custom_models/"
        )
    # without them fla fails after the processes started: mamba3 inside step 1, the options while building the model
    for package in support.packages_needed(config):
        if importlib.util.find_spec(package.module) is None:
            subject = f"{support.name} with {package.option} true" if package.option else support.name
            alternative = f", or set {package.option} to false in the model config" if package.option else ""
            raise ConfigError(f"{subject} needs {package.purpose}: {package.install} (not installed here){alternative}")
    if support.tilelang_on_hopper and device.CUDA:
        check_tilelang_on_hopper(support)
    if job_config.checkpoint.export_as == "llama":  # the export comes after training: refuse it before
        llama_export.check(config)
    if config.model_type == "mamba3":
        check_mamba3_kernels(config)
    if support.documents is Documents.ATTENTION:
        check_attention_settings(config)
    if (adapters := lora.LoraSettings.of(job_config.lora)) is not None:
        lora.resolve_targets(model.meta, adapters)  # each entry names some layer
    elif job_config.optimizer.param_groups:  # (under LoRA only the adapters train: judged on the built model)
        check_rules_select(model.meta, job_config.optimizer.param_groups)
    if (fp8 := float8.Float8Settings.of(job_config.float8)) is not None:
        float8.eligible_layers(model.meta, fp8.skip)  # each --float8.filter_fqns entry names some layer


def check_checkpointed_blocks(config: PretrainedConfig, ac) -> None:
    """AC that names blocks the model does not have checkpoints fewer than the user meant, or none at all."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
    if not isinstance(layers, int):
        return
    option = str(ac.selective_ac_option)
    if ac.mode == "selective" and option.lstrip("-").isdigit():
        every = int(option)
        if every < 1:
            raise ConfigError(f"--activation_checkpoint.selective_ac_option {every}: AC of every N-th block needs N >= 1 "
                              "(1: every block), or 'op' for per-operator AC")
        if every > layers:
            raise ConfigError(f"--activation_checkpoint.selective_ac_option {every} checkpoints every {every}th block, and "
                              f"the model has {layers}: none would be; give 1 to {layers}, or --activation_checkpoint.mode "
                              "none")
    if ac.mode == "full" and ac.blocks is not None and ac.blocks > layers:
        raise ConfigError(f"--activation_checkpoint.blocks {ac.blocks} is more than the model's {layers} blocks: give 1 "
                          f"to {layers} (all of them: leave it unset)")


def check_tilelang_on_hopper(support) -> None:
    """Refuse a type whose backward fla runs on this GPU only through TileLang, where TileLang is missing.

    fla's Triton kernel for the gated chunk backward is refused on Hopper with Triton 3.4 to
    3.7.0 (flame.compat.fla.gated_chunk_backward_refused), and fla would raise inside the first
    backward, after the kernels compiled and autotuned for minutes; TileLang's kernel replaces it.
    """
    import triton

    if compat.fla.gated_chunk_backward_refused() and importlib.util.find_spec("tilelang") is None:
        raise ConfigError(
            f"{support.name} trains on Hopper GPUs with Triton {triton.__version__} only through TileLang (fla runs "
            "its backward there, Triton's computes it wrong: fla issue #640): install it (3rdparty/install.sh does on a GPU machine; "
            "pip install flame[gpu] or pip install tilelang==0.1.15), or use Triton >= 3.7.1"
        )


def check_attention_settings(config: PretrainedConfig) -> None:
    """Refuse HF attention settings that only flash-attn/eager kernels implement, not flame's attention."""
    if getattr(config, "attn_logit_softcapping", None):
        raise ConfigError(
            f"{config.model_type}: attn_logit_softcapping needs eager/flash-attn attention, which flame's document "
            "attention does not replace; set it to null in the model config"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ConfigError(
            f"{config.model_type}: attention_dropout {config.attention_dropout} is not supported by flame's document "
            "attention; set it to 0.0 in the model config"
        )


def check_mamba3_kernels(config: PretrainedConfig) -> None:
    """Refuse a mamba3 config that mamba_ssm's kernels here cannot run (flame.compat.mamba_ssm loads them)."""
    if config.is_mimo:
        if config.chunk_size * config.mimo_rank > 64:  # mamba_ssm's Mamba3 module: "64/mimo_rank for MIMO"
            raise ConfigError(
                f"fla's mamba3 with is_mimo true: chunk_size {config.chunk_size} x mimo_rank {config.mimo_rank} "
                "needs more shared memory than a GPU has in mamba_ssm's MIMO kernels (410 KB at 64 x 4; a "
                f"Hopper GPU has 227 KB); set chunk_size to {max(64 // config.mimo_rank, 1)} in the model config"
            )
        if unmet := _unmet_requirement("mamba_ssm", "tilelang"):  # TileLang 0.1.15's compiler fails on them
            required, installed = unmet
            raise ConfigError(
                f"fla's mamba3 with is_mimo true runs mamba_ssm's TileLang kernels, written for {required}, not the "
                f"{installed} installed: pip install '{required}', or set is_mimo to false in the model config"
            )
    kernel = "mamba3_mimo_combined" if config.is_mimo else "mamba3_siso_combined"
    if error := compat.mamba_ssm.mamba3_kernel_errors.get(kernel):
        install = support_for("mamba3").package("mamba_ssm").install
        raise ConfigError(
            f"fla's mamba3 found no {kernel} in the mamba_ssm installed here ({error}); mamba-ssm >= 2.3.2 "
            f"has the Mamba-3 kernels: {install} --upgrade"
        )


def _unmet_requirement(package: str, dependency: str) -> tuple[str, str] | None:
    """``package``'s requirement on ``dependency`` and the version installed, when that version does not meet it."""
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
