"""The layouts that keep part of the training state on the host, checked: --optimizer.on_host (AdamW's state
stepped there, flame.optim.host) and --memory.stream_weights (the weights too, flame.optim.streaming). Each steps
AdamW or Adam on the host; what either cannot combine with is refused in one line, before any process starts."""

from typing import Any

from flame.base.errors import ConfigError
from flame.optim.record import OPTIMIZERS, optimizer_record


def check(config: Any, world_size: int) -> None:
    _check_host_optimizer(config)
    _check_streaming(config, world_size)


def _check_host_optimizer(config: Any) -> None:
    """--optimizer.on_host steps AdamW or Adam on the host, one model at a time."""
    if config.optimizer.gpu_blocks < 0:
        raise ConfigError(f"--optimizer.gpu_blocks {config.optimizer.gpu_blocks}: a count of decoder blocks, 0 or more")
    if not config.optimizer.on_host:
        if config.optimizer.gpu_blocks:
            raise ConfigError("--optimizer.gpu_blocks keeps some of the optimizer state on the GPU when the rest is on "
                              "the host: add --optimizer.on_host, or drop gpu_blocks")
        return
    record = optimizer_record(config.optimizer.name)
    if not record.steps_on_host:
        hosted = [other.name for other in OPTIMIZERS.values() if other.steps_on_host]
        raise ConfigError(f"--optimizer.on_host steps {' or '.join(hosted)} on the host; {record.on_gpu_only}: use "
                          f"--optimizer.name {hosted[0]}, or leave on_host off")
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("--optimizer.on_host waits for each decoder block's weights in its forward, which pipeline "
                          "stages run out of order: leave it off under --parallelism.pipeline_parallel_degree > 1")


def _check_streaming(config: Any, world_size: int) -> None:
    """--memory.stream_weights streams one process's weights, stepped by AdamW or Adam on the host
    (flame.optim.streaming); the layouts and features it does not combine with yet, refused."""
    if not config.memory.stream_weights:
        return
    flag = "--memory.stream_weights"
    if world_size > 1:
        raise ConfigError(f"{flag} streams one process's weights, and this job runs {world_size}: on several GPUs shard "
                          "them with FSDP (and stream FSDP's shards with --training.enable_cpu_offload "
                          "--optimizer.on_host), or run one process")
    record = optimizer_record(config.optimizer.name)
    if not record.steps_on_host:
        hosted = [other.name for other in OPTIMIZERS.values() if other.steps_on_host]
        raise ConfigError(f"{flag} steps {' or '.join(hosted)} on the host; {record.on_gpu_only}: use "
                          f"--optimizer.name {hosted[0]}, or leave stream_weights off")
    others = {
        "--training.enable_cpu_offload": config.training.enable_cpu_offload,
        "--optimizer.on_host": config.optimizer.on_host,
        "--parallelism.fsdp_one_rank": config.parallelism.fsdp_one_rank,
        "--training.ema_decay": config.training.ema_decay > 0,
        "--float8.recipe_name": config.float8.recipe_name != "off",
        "--compile.enable (--training.compile)": config.compile.enable,
    }
    if given := [name for name, on in others.items() if on]:
        raise ConfigError(f"{flag} does not combine with {given[0]} yet: the weights live on the host as the model's "
                          f"float32 parameters and only visit the GPU; drop one of the two")
