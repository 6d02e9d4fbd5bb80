"""The layouts that keep part of the training state on the host, checked: --optimizer.on_host (AdamW's state
stepped there, flame.optim.host) and --memory.stream_weights (the weights too, flame.optim.streaming). Each steps
AdamW or Adam on the host; what either cannot combine with is refused in one line, before any process starts."""

from typing import Any

from flame.base.errors import ConfigError
from flame.optim import streaming
from flame.optim.record import host_step_refusal


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
    if (refused := host_step_refusal(config.optimizer.name, "--optimizer.on_host")) is not None:
        raise ConfigError(refused)
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("--optimizer.on_host waits for each decoder block's weights in its forward, which pipeline "
                          "stages run out of order: leave it off under --parallelism.pipeline_parallel_degree > 1")


def _check_streaming(config: Any, world_size: int) -> None:
    """--memory.stream_weights streams the weights (each data-parallel process its shard), stepped by AdamW or Adam
    on the host (flame.optim.streaming); the layouts and features it does not combine with yet, refused."""
    if config.memory.stream_weights and (refused := streaming.refusal(config, world_size)) is not None:
        raise ConfigError(refused)
