"""Spellings of flame's settings beside the fields themselves (flame.config.job).

``MOVED_JOB_FILES`` maps the job files' paths of earlier flame versions onto where they are now.
``ALIASES`` maps each older spelling that flame users know from earlier flame (and torchtitan)
versions, and that still means the same, onto torchtitan's field; ``REFUSED_SPELLINGS`` names
the replacement of each one whose meaning changed or is gone; ``UNUSED_TORCHTITAN_FIELDS`` are
torchtitan's fields flame does not use, refused rather than silently ignored.
``flame.config.merge`` applies all three.
"""

import operator
import re
from collections.abc import Callable
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
    "experimental.pipeline_parallel_split_points": _block_indices,
}

NO_MEMORY_ESTIMATOR = (
    "flame's memory plan (--memory.plan auto, the default) prints the estimate at the start, and every "
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
    "model.converters": "float8/mx converters need torchao, which flame does not ship",
    "training.dataset_path": "use --training.dataset (paths are accepted there)",
    "training.global_batch_size": "use --training.batch_size and --training.gradient_accumulation_steps",
    "checkpoint.initial_load_in_hf": (
        "start from the HF model with --model.init_from <hf dir> (or convert it first: python -m "
        "flame.utils.convert_hf_to_dcp --model <hf dir> --checkpoint <dump_folder>/checkpoint/step-0)"
    ),
    "checkpoint.initial_load_in_hf_quantized": "flame loads no quantized HF weights; convert a bf16/fp32 HF model",
    "checkpoint.last_save_in_hf": "train.sh exports the last checkpoint to <dump_folder>/hf itself",
    "model.print_after_conversion": "flame applies no model converters",
    "quantize": "float8/mx training needs torchao, which flame does not ship",
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
    "parallelism.pipeline_parallel_expert_parallel_overlap": "flame does not provide expert parallelism",
    "parallelism.expert_parallel_comm_backend": "flame does not provide expert parallelism",
    "debug.moe_force_load_balance": "it balances the experts of torchtitan's own MoE models, which flame does not build",
}
