"""A job's parallel layout from its config, checked before any process group exists: the degrees
that multiply to the world size, and whether FSDP (with its mixed precision) wraps the processes.
Errors are ``ConfigError``: one line saying what is wrong and what to change."""

import torch
from torchtitan.config import JobConfig

from flame.base import device
from flame.base.errors import ConfigError


def data_parallel_degree(config: JobConfig, world_size: int) -> int:
    """Ranks that read different data (replicate x shard), after checking the layout."""
    p = config.parallelism
    fixed = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for name, degree in {**fixed, "data_parallel_shard_degree": p.data_parallel_shard_degree}.items():
        if degree < 1 and name != "data_parallel_shard_degree":
            raise ConfigError(f"--parallelism.{name} must be >= 1, got {degree}")
        if degree > 1 and world_size % degree:
            raise ConfigError(
                f"--parallelism.{name} {degree} does not divide the {world_size} processes: "
                f"make it a divisor of {world_size}, or run a multiple of {degree} processes (NGPU x NNODE)"
            )
    others = 1
    for degree in fixed.values():
        others *= degree
    shard = p.data_parallel_shard_degree
    layout = " x ".join(f"{k.removesuffix('_degree')}={v}" for k, v in fixed.items() if v > 1) or "no other parallelism"
    if shard == -1:
        if world_size % others:
            raise ConfigError(
                f"world size {world_size} is not divisible by {layout} ({others}): "
                "change the parallel degrees or the number of processes (NGPU x NNODE)"
            )
        shard = world_size // others
    elif shard < 1:
        raise ConfigError(f"--parallelism.data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    if shard * others != world_size:
        raise ConfigError(
            f"parallel degrees multiply to {shard * others} (data_parallel_shard={shard}, {layout}) "
            f"but there are {world_size} processes: make them multiply to {world_size} "
            "(data_parallel_shard_degree -1 takes the remaining processes)"
        )
    _check_available_parallelism(p, shard)
    return p.data_parallel_replicate_degree * shard


def _check_available_parallelism(p, shard: int) -> None:
    """flame runs FSDP2, HSDP, DDP, tensor, context, pipeline and expert parallelism; other layouts are refused rather
    than run wrong (the model-dependent checks of expert parallelism: flame.distributed.expert_parallel)."""
    if p.expert_tensor_parallel_degree > 1:
        raise ConfigError(f"--parallelism.expert_tensor_parallel_degree {p.expert_tensor_parallel_degree}: flame does "
                          "not split single experts over ranks; leave it at 1 (expert_parallel_degree splits the "
                          "experts among ranks)")
    ep = p.expert_parallel_degree
    if ep < 1:
        raise ConfigError(f"--parallelism.expert_parallel_degree must be >= 1, got {ep}")
    if ep > 1 and shard % ep:
        raise ConfigError(f"--parallelism.expert_parallel_degree {ep} does not divide the {shard} data-parallel shard "
                          f"ranks it splits the experts over: give a divisor of {shard}")
    # DDP replicates plain tensors (no DTensor shards), and its reducer runs wrong when a pipeline
    # schedule takes several forwards before their backwards (measured: replicas drift apart)
    replicas = p.data_parallel_replicate_degree
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if replicas > 1 and shard == 1 and p.context_parallel_degree == 1 and getattr(p, name) > 1:
            raise ConfigError(
                f"DDP (--parallelism.data_parallel_replicate_degree {replicas} with data_parallel_shard_degree 1) "
                f"does not combine with --parallelism.{name} {getattr(p, name)}: shard instead "
                f"(FSDP: data_parallel_shard_degree {replicas}, replicate degree 1; or HSDP: both degrees > 1)"
            )


def fsdp_enabled(config: JobConfig, world_size: int) -> bool:
    """Whether FSDP (and with it mixed precision) wraps this job's processes."""
    shard = data_parallel_degree(config, world_size) // config.parallelism.data_parallel_replicate_degree
    # CP shards over the dp x cp mesh
    return shard > 1 or config.parallelism.context_parallel_degree > 1 or fsdp_alone(config, world_size)


def float32_compute(config: JobConfig, world_size: int) -> str | None:
    """Why this job computes in float32 (a phrase), or None when it runs under bf16/fp16 mixed precision."""
    if not device.CUDA:
        return "CPU runs compute in float32"
    if config.training.mixed_precision_param == "float32":
        return "--training.mixed_precision_param float32"
    p = config.parallelism
    # torchtitan: FSDP casts the weights; without it, only a plain or DDP run gets autocast
    if not fsdp_enabled(config, world_size) and (p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1):
        return "tensor/pipeline parallelism without FSDP, where torchtitan applies no mixed precision"
    return None


def frozen_weights_dtype(config: JobConfig, world_size: int) -> torch.dtype:
    """The dtype LoRA's frozen base weights are held in (flame.models.lora.hold_base_in): the compute dtype under
    mixed precision, where every matmul reads them in it, else float32."""
    return torch.float32 if float32_compute(config, world_size) else device.compute_dtype(config)


def fsdp_alone(config: JobConfig, world_size: int) -> bool:
    """One process that flame wraps in FSDP over a one-rank mesh (flame.distributed.parallelize): to offload
    it (FSDP2's CPUOffloadPolicy is the offload), to step its optimizer on the host (--optimizer.on_host), or
    because --parallelism.fsdp_one_rank asks for FSDP's mixed precision.

    Why the second: such a job is one too large for its GPU, and FSDP's mixed precision casts each
    block's weights to bf16 as it runs, where autocast keeps a bf16 copy of every weight all step and
    a float32 residual stream (for a 7B, twice the checkpointed block inputs: docs/perf-log.md).
    """
    p = config.parallelism
    return world_size == 1 and (config.training.enable_cpu_offload or config.optimizer.on_host or p.fsdp_one_rank)


def check_fsdp_options(config: JobConfig, world_size: int) -> None:
    """Options that only FSDP acts on are refused without it (torchtitan would ignore them)."""
    p = config.parallelism
    if fsdp_enabled(config, world_size):
        return
    without = "DDP" if p.data_parallel_replicate_degree > 1 else "a run without data-parallel sharding"
    fix = "shard the weights with --parallelism.data_parallel_shard_degree > 1"
    if p.fsdp_one_rank:
        raise ConfigError(f"--parallelism.fsdp_one_rank wraps one process in FSDP, but this is {without} over {world_size} "
                          f"processes: {fix}, or leave it off")
    if config.training.enable_cpu_offload:
        raise ConfigError(
            f"--training.enable_cpu_offload offloads FSDP-sharded weights (or one process's), but this is {without} "
            f"over {world_size} processes: {fix}, run one process, or leave it off"
        )
    if p.fsdp_reshard_after_forward != "default":
        raise ConfigError(
            f"--parallelism.fsdp_reshard_after_forward {p.fsdp_reshard_after_forward} applies to FSDP, but this is {without}: "
            f"{fix}, or leave it at default"
        )
