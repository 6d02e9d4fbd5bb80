"""Spellings of flame's settings beside the fields themselves (flame.config.job).

``MOVED_JOB_FILES`` maps the job files' paths of earlier flame versions onto where they are now.
``ALIASES`` maps each older spelling that flame users know from earlier flame (and torchtitan)
versions, and that still means the same, onto torchtitan's field; ``REFUSED_SPELLINGS`` names
the replacement of each one whose meaning changed or is gone; ``UNUSED_TORCHTITAN_FIELDS`` are
torchtitan's fields flame does not use, refused rather than silently ignored.
``OLDER_KEYS`` are the keys of older flame (and torchtitan 0.1/0.2) job files that are no fields at all any
more: each moves onto today's field, or is accepted while its value changes nothing, or is refused.
``flame.config.merge`` applies them all.
"""

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flame.base.errors import ConfigError

# job files under the paths earlier flame versions kept them at -> where they are now (flame.config.manager.resolve_path)
MOVED_JOB_FILES: dict[str, str] = {
    "flame/models/flame.toml": "configs/flame.toml",
    "flame/models/fla.toml": "configs/fla.toml",
}

# alias field -> the torchtitan field it stands for
ALIASES: dict[str, str] = {
    "training.batch_size": "training.local_batch_size",
    "training.num_workers": "training.dataloader.num_workers",
    "training.prefetch_factor": "training.dataloader.prefetch_factor",
    "training.seed": "debug.seed",
    "training.compile": "compile.enable",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "optimizer.scheduler": "lr_scheduler.decay_type",
    "optimizer.min_lr_ratio": "lr_scheduler.min_lr_factor",
    "optimizer.fused": "optimizer.implementation",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.deterministic": "debug.deterministic",
    "training.disable_loss_parallel": "parallelism.disable_loss_parallel",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "metrics.rank_0_only": "metrics.save_for_all_ranks",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_split_points": "parallelism.pipeline_parallel_split_points",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "float8.enable_float8_linear": "float8.recipe_name",
}


def _decay_type(scheduler: str) -> str:
    if scheduler not in ("linear", "sqrt", "cosine"):
        raise ConfigError(
            f"--optimizer.scheduler {scheduler}: give the decay shape with --lr_scheduler.decay_type (linear, sqrt, "
            "cosine); a warmup-stable-decay schedule is --lr_scheduler.decay_ratio, the fraction of steps that decay"
        )
    return scheduler


def _block_indices(split_points: list[str] | str) -> str:
    """Module names that start pipeline stages ('layers.4') -> the block indices flame takes ('4')."""
    names = split_points.split(",") if isinstance(split_points, str) else split_points
    indices = []
    for name in names:
        match = re.fullmatch(r"(?:.*\.)?(\d+)", name.strip())
        if match is None:
            raise ConfigError(
                f"--experimental.pipeline_parallel_split_points: {name!r} names no decoder block; give the index of "
                "the first block of every stage after the first: --parallelism.pipeline_parallel_split_points 4,8"
            )
        indices.append(match.group(1))
    return ",".join(indices)


# alias -> how its value becomes the value of the field it stands for (default: unchanged)
ALIAS_VALUES: dict[str, Callable[[Any], Any]] = {
    "optimizer.scheduler": _decay_type,
    "optimizer.fused": lambda fused: "fused" if fused else "foreach",
    "metrics.rank_0_only": operator.not_,
    "float8.enable_float8_linear": lambda enabled: "tensorwise" if enabled else "off",
    "experimental.pipeline_parallel_split_points": _block_indices,
}

NO_MEMORY_ESTIMATOR = (
    "flame's memory plan (--memory.plan auto) prints the estimate at the start, and every "
    "logged step the peak memory (mem ... GiB)"
)

# older spellings whose meaning changed or is gone -> what to give instead
REFUSED_SPELLINGS: dict[str, str] = {
    "experimental.pipeline_parallel_microbatches": (
        "use --parallelism.pipeline_parallel_microbatch_size, the rows per microbatch "
        "(local batch size / microbatches)"
    ),
    "experimental.pipeline_parallel_schedule_csv": "flame builds the schedule from --parallelism.pipeline_parallel_schedule",
    "experimental.pipeline_parallel_split_mode": (
        "flame splits the model by decoder blocks; choose them with --parallelism.pipeline_parallel_split_points"
    ),
    "memory_estimation.enabled": NO_MEMORY_ESTIMATOR,
}

# torchtitan fields (or whole sections) that flame does not use: setting one is an error, not a silent no-op.
UNUSED_TORCHTITAN_FIELDS: dict[str, str] = {
    "model.flavor": "flame builds the model from --model.config",
    "model.hf_assets_path": "use --model.tokenizer_path and --model.config",
    "model.converters": "flame's one converter is FP8 (--float8.recipe_name; 'float8' and 'quantize.linear.float8' "
                        "are read as it); MX formats are not part of flame",
    "training.dataset_path": "use --training.dataset (paths are accepted there)",
    "checkpoint.initial_load_in_hf": (
        "start from the HF model with --model.init_from <hf dir> (or convert it first: python -m "
        "flame.utils.convert_hf_to_dcp --model <hf dir> --checkpoint <dump_folder>/checkpoint/step-0)"
    ),
    "checkpoint.initial_load_in_hf_quantized": "flame loads no quantized HF weights; convert a bf16/fp32 HF model",
    "checkpoint.last_save_in_hf": "train.sh exports the last checkpoint to <dump_folder>/hf itself",
    "model.print_after_conversion": "flame logs the layers FP8 converts (--float8.recipe_name)",
    "quantize": "FP8 is --float8.recipe_name (quantize.linear.float8 is read with model.converters naming it); "
                "flame has no MX formats or FP8 grouped GEMMs",
    "validation.dataset_path": "use --validation.dataset (paths are accepted there)",
    "validation.dataloader": "flame packs the validation set once, in each rank's main process",
    "fault_tolerance": "torchft is not part of flame's stack",
    "checkpoint.enable_ft_dataloader_checkpoints": "it applies to torchft runs, which flame does not provide",
    "memory_estimation.enable": NO_MEMORY_ESTIMATOR,
    "memory_estimation.disable_fake_mode": NO_MEMORY_ESTIMATOR,
    "experimental.custom_import": "custom architectures go under custom_models/",
    "experimental.custom_args_module": "flame sets the config module itself",
    "comm.mode": "fake/local-tensor comm modes are not supported by flame",
    "optimizer.early_step_in_backward": "it steps before gradient clipping and the non-finite check",
    "parallelism.module_fqns_per_model_part": "use --parallelism.pipeline_parallel_split_points",
    "parallelism.pipeline_parallel_layers_per_stage": "use --parallelism.pipeline_parallel_split_points",
    "parallelism.pipeline_parallel_schedule_csv": "flame builds the schedule from --parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_expert_parallel_overlap": "flame refuses pipeline parallelism for MoE models",
    "parallelism.expert_parallel_comm_backend": "flame's expert parallelism exchanges tokens with torch's all-to-all "
                                                "(flame.models.experts); DeepEP is not part of its stack",
    "debug.moe_force_load_balance": "it balances the experts of torchtitan's own MoE models, which flame does not build",
}


@dataclass(frozen=True)
class OlderKey:
    """A key of an older flame or torchtitan job file that today's JobConfig has no field for.

    ``becomes``: today's field it stands for (its value carries over). Otherwise it is accepted while its
    value is one of ``unchanged`` (None: any value; the setting it was has no effect in flame) and refused
    with ``fix``, which names what to do instead.
    """

    becomes: str = ""
    unchanged: tuple[Any, ...] | None = ()
    fix: str = ""

    def changes_nothing(self, value: Any) -> bool:
        # type-strict: TOML's 0 is not false
        return self.unchanged is None or any(type(value) is type(v) and value == v for v in self.unchanged)


_MX = "mx training needs torchao, which flame does not ship; leave [mx] out"
_TORCHFT = "torchft is not part of flame's stack; leave it out"
_COMPILED_AUTOGRAD = "torchtitan 0.2 dropped compiled autograd; --compile.enable compiles each decoder block"

# older key (dotted) -> what it is today. float8.*, mx.* and fault_tolerance.*'s settings only shaped a
# conversion or a torchft run that nothing else turns on in flame (model.converters and fault_tolerance.enable
# are refused), so any value of theirs changes nothing; float8.enable_float8_linear turned float8 on itself.
OLDER_KEYS: dict[str, OlderKey] = {
    "job.print_args": OlderKey(becomes="job.print_config"),
    "job.use_for_integration_test": OlderKey(unchanged=None, fix="it marked torchtitan's own test configs; leave it out"),
    "model.norm_type": OlderKey(unchanged=None, fix="the model config (--model.config) sets the norm; leave it out"),
    "training.pin_memory": OlderKey(becomes="training.dataloader.pin_memory"),
    "training.persistent_workers": OlderKey(becomes="training.dataloader.persistent_workers"),
    "training.fsdp_reshard_after_forward": OlderKey(becomes="parallelism.fsdp_reshard_after_forward"),
    "training.debug_moe_force_load_balance": OlderKey(
        unchanged=(False,), fix="it balanced torchtitan's own MoE models, which flame does not build; leave it out"
    ),
    "checkpoint.interval_type": OlderKey(
        unchanged=("steps", "step"), fix="--checkpoint.interval counts steps, never seconds; leave interval_type out"
    ),
    "checkpoint.last_save_model_weights_only": OlderKey(becomes="checkpoint.last_save_model_only"),
    "checkpoint.initial_load_model_weights_only": OlderKey(becomes="checkpoint.initial_load_model_only"),
    "experimental.enable_async_tensor_parallel": OlderKey(becomes="parallelism.enable_async_tensor_parallel"),
    "experimental.context_parallel_rotate_method": OlderKey(becomes="parallelism.context_parallel_rotate_method"),
    "experimental.enable_compiled_autograd": OlderKey(unchanged=(False,), fix=_COMPILED_AUTOGRAD),
    "parallelism.enable_compiled_autograd": OlderKey(unchanged=(False,), fix=_COMPILED_AUTOGRAD),
    "experimental.custom_model_path": OlderKey(
        unchanged=("",), fix="put the architecture under custom_models/, which flame registers with transformers"
    ),
    "activation_offload.mode": OlderKey(
        unchanged=("none",),
        fix="flame offloads no activations; --activation_checkpoint.mode full (or --memory.plan auto) saves their memory",
    ),
    "float8.emulate": OlderKey(
        unchanged=(False,), fix="flame emulates the FP8 matmuls on CPUs by itself and runs them natively on GPUs; leave it out"
    ),
    "float8.force_recompute_fp8_weight_in_bwd": OlderKey(unchanged=None, fix="torchao no longer has it; leave it out"),
    **{f"float8.scaling_type_{name}": OlderKey(
        unchanged=("dynamic",), fix="torchao dropped delayed scaling: flame scales dynamically; leave it out"
    ) for name in ("input", "weight", "grad_output")},
    **{f"mx.{name}": OlderKey(unchanged=None, fix=_MX) for name in (
        "use_fp8_dim1_cast_triton_kernel", "recipe_name", "filter_fqns",
    )},
    **{f"fault_tolerance.{name}": OlderKey(unchanged=None, fix=_TORCHFT) for name in (
        "sync_steps", "should_quantize", "fragment_sync_delay", "fragment_update_alpha",
    )},
}
