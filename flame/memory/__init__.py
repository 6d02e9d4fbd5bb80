"""flame's memory plan (--memory.plan): fit a job into its GPU budget before any process group exists.

``apply`` runs in ``flame.prepare.prepare``, in train.sh's preflight and on every rank
alike, so every process takes the same plan and a job that cannot fit stops in one line before
anything is built. The estimate is ``flame.memory.estimate``'s, the choice ``flame.memory.plan``'s, the layouts' prices
``flame.memory.price``'s; the activations are measured by ``flame.memory.activations``, and the
machine's rates that price the layouts by ``flame.memory.hardware`` (the preflight measures them,
the ranks read its cache). Rank 0 logs
the plan's table; the trainer logs the measured peak beside the estimate after the first logged
step (GPU only), and, with several ranks, checks that all of them took the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable

from torch import nn
from torchtitan.tools.logging import logger

from flame.base import device
from flame.base.errors import ConfigError
from flame.distributed.degrees import data_parallel_degree, fsdp_enabled, frozen_weights_dtype
from flame.memory import activations
from flame.memory.estimate import GIB, estimate, gpu_bytes
from flame.memory.layout import (
    FIRST,
    Job,
    Layout,
    as_run,
    count_params,
    dtype_bytes,
    first_blocks,
)
from flame.memory.plan import HOST_SHARE, Plan, choose, table
from flame.models import lora, moe
from flame.models.inputs import is_fla_config
from flame.models.kernels.attention import backend_for
from flame.models.model_config import load_model_config
from flame.models.registry import decoder_layers, meta_model
from flame.optim import pinned, streaming
from flame.optim.host import leading_units, units_of
from flame.optim.record import optimizer_record
from flame.optim.stream_units import chunk_numel

GPU_RESERVE_GIB = 1.0  # outside PyTorch's allocator: the CUDA context, NCCL's buffers


def _budget(flag: str, value: str) -> float | None:
    """An explicit budget in bytes, or None for auto."""
    if value.strip() == "auto":
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise ConfigError(f"--memory.{flag} must be auto or a positive number of GiB, got {value!r}")
    return gib * GIB


def budgets(config) -> tuple[float | None, float | None]:
    """(GPU bytes, host bytes) one process may use; GPU None on a CPU machine left at auto."""
    m = config.memory
    gpu = _budget("gpu_budget_gib", m.gpu_budget_gib)
    if gpu is None and device.CUDA:
        import torch

        if count := torch.cuda.device_count():  # none visible (a launcher node without GPUs): nothing to read
            local = int(os.environ.get("LOCAL_RANK", "0")) % count
            gpu = torch.cuda.get_device_properties(local).total_memory - GPU_RESERVE_GIB * GIB
    host = _budget("host_budget_gib", m.host_budget_gib)
    if host is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        ram = _available_ram()
        host = HOST_SHARE * ram / processes if ram else None
    return gpu, host


def _available_ram() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def job_of(config, world_size: int, model_config=None, meta: Callable[[], nn.Module] | None = None) -> Job:
    """The job as the estimate sees it: the model built on the meta device, the layout's degrees.

    ``model_config`` and ``meta`` (gives the model on the meta device): the ones flame.prepare read and built for
    its checks; read and built here when not given (the trainer's log of the estimate).
    """
    model_config = model_config or load_model_config(config.model.config)
    model = meta() if meta is not None else meta_model(model_config)
    params, matrices, block = count_params(model, decoder_layers(model))
    frozen = 0
    if (adapters := lora.LoraSettings.of(config.lora)) is not None:  # the model's own weights freeze beside them
        frozen, params = params, params + lora.adapter_params(model, adapters)
    p, t = config.parallelism, config.training
    fsdp = fsdp_enabled(config, world_size)
    shards = data_parallel_degree(config, world_size) // p.data_parallel_replicate_degree if fsdp else 1
    if fsdp:
        shards *= p.context_parallel_degree
    dtype = device.compute_dtype(config)
    # Eager HF blocks on a GPU run flame's fused norms and MLPs (flame.models.builder), which keep less than HF's
    # code. Compiled blocks run HF's code, but inductor fuses its elementwise ops and keeps about what the fused
    # kernels keep: they stand in for it (HF's eager code overestimated a compiled llama by half: docs/perf-log.md,
    # 2026-11-28).
    fused = device.CUDA and (config.model.fused_kernels or config.compile.enable) and not is_fla_config(model_config)
    attention = backend_for(config.model.attention, cuda=device.CUDA)
    pipelined = p.pipeline_parallel_degree > 1
    frozen_bytes = dtype_bytes(frozen_weights_dtype(config, world_size))
    # torchtitan's AMP: float32 weights, autocast keeps cast copies. LoRA's base held in the compute dtype (its
    # embeddings too, lora.hold_base_in) makes the residual stream that dtype's, and leaves autocast only the
    # adapters (two small matrices a layer) to cast
    autocast = not fsdp and dtype_bytes(dtype) < 4 and not (frozen and frozen_bytes < 4)
    optimizer = optimizer_record(config.optimizer.name)
    units = stream_units(model)
    shard_units = stream_units(model, shards)
    job = Job(
        params=params, matrix_params=matrices, block_params=block, vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size, compute_bytes=dtype_bytes(dtype),
        hidden_bytes=4 if autocast else dtype_bytes(dtype), optimizer=optimizer, rows=t.local_batch_size,
        accumulates=t.gradient_accumulation_steps > 1,
        tokens_per_row=t.seq_len // p.context_parallel_degree,
        weight_shards=shards * p.tensor_parallel_degree * p.pipeline_parallel_degree, fsdp=fsdp,
        alone=fsdp and world_size == 1,
        can_offload=device.CUDA and (fsdp or world_size == 1),
        can_step_on_host=device.CUDA and optimizer.steps_on_host and not pipelined,
        gpu_state_params=gpu_state_params(model, config.optimizer.gpu_blocks, fsdp),
        autocast_copies=autocast, fused_loss=device.fused_cross_entropy_enabled(config, model_config.vocab_size),
        expandable_segments=expandable_segments(config), dense_attention=attention == "sdpa",
        tensor_parallel=p.tensor_parallel_degree, pipelined=pipelined, ema=t.ema_decay > 0,
        activations=activations.measure(model_config, dtype, fused, autocast, attention=attention, adapters=adapters),
        active_params=moe.active_params(model) if moe.is_moe(model_config) else None,
        can_park_inputs=device.CUDA and not pipelined,
        frozen_params=frozen, frozen_bytes=frozen_bytes,
        offload_pinning=offload_pinning(model, shards), host_copy_pinning=host_copy_pinning(model, shards),
        can_stream=device.CUDA and streaming.refusal(config, world_size) is None,
        resident_params=units[0], stream_pinning=stream_pinning(shard_units, dtype_bytes(dtype)),
    )
    if device.CUDA and world_size == 1 and not fsdp:
        # CPU offload or the optimizer on the host would wrap this process in FSDP (degrees.fsdp_alone)
        job = dataclasses.replace(job, wrapped=functools.cache(lambda: dataclasses.replace(
            job, fsdp=True, alone=True, autocast_copies=False, hidden_bytes=dtype_bytes(dtype), wrapped=None,
            gpu_state_params=gpu_state_params(model, config.optimizer.gpu_blocks, True),
            activations=activations.measure(model_config, dtype, fused, False, attention=attention, adapters=adapters))))
    return job


def stream_units(model: nn.Module, shards: int = 1) -> list[int]:
    """The parameters of each unit --memory.stream_weights moves (flame.optim.streaming): the rest of the model
    (embeddings, final norm, head), then each decoder block; over ``shards`` ranks, one rank's padded chunks."""
    def count(params) -> int:
        return sum(chunk_numel(p.shape, shards) for p in params)

    blocks = decoder_layers(model)
    return [count(model.parameters()) - count(blocks.parameters()), *(count(block.parameters()) for block in blocks)]


def stream_pinning(units: list[int], itemsize: int) -> float:
    """Bytes --memory.stream_weights pins over what it holds: each unit's float32 masters and its gradients'
    landing (``itemsize`` bytes an element) from the arena's chunks (flame.optim.pinned)."""
    buffers = [size for numel in units for size in (numel, -(-itemsize * numel // 4))]
    return pinned.arena_bytes(buffers, pinned.least_wasting_chunk(buffers)) / max(4 * sum(buffers), 1)


def _local_numels(model: nn.Module, shards: int) -> list[list[int]]:
    """Each trainable parameter's part on one rank (FSDP splits dim 0, padded), by the host optimizer's units."""
    return [[chunk_numel(param.shape, shards) for param in unit.params] for unit in units_of(model)]


def offload_pinning(model: nn.Module, shards: int) -> float:
    """Bytes FSDP's CPU offload pins for the weights (and again for the gradients) over their own: each shard is
    rounded up to a power of two (flame.optim.pinned)."""
    numels = [n for unit in _local_numels(model, shards) for n in unit]
    return sum(pinned.allocated(4 * n) for n in numels) / max(4 * sum(numels), 1)


def host_copy_pinning(model: nn.Module, shards: int) -> float:
    """Bytes the host optimizer's pinned copies take over their own: each unit's weights, then its gradients,
    from the arena's chunks (flame.optim.pinned)."""
    units = _local_numels(model, shards)
    exact = 2 * 4 * sum(map(sum, units))
    asked = [n for unit in units for n in (*unit, *unit)]
    return pinned.arena_bytes(asked, pinned.chunk_bytes_for(exact)) / max(exact, 1)


def gpu_state_params(model, gpu_blocks: int, fsdp: bool) -> int:
    """The parameters whose optimizer state ``--optimizer.gpu_blocks`` keeps on the GPU (with --optimizer.on_host):
    those of the units the forward computes up to the last of those blocks (flame.optim.host)."""
    units = units_of(model)
    counted = units[: leading_units(units, model, gpu_blocks)]
    if fsdp and counted and units[-1].after:  # under FSDP the head and the final norm join the embeddings' unit
        counted.append(units[-1])
    return sum(p.numel() for unit in counted for p in unit.params)


def layout_of(config) -> Layout:
    """The settings the plan may change, as the job gives them."""
    ac = config.activation_checkpoint
    mode = {"selective": "op" if ac.selective_ac_option == "op" else str(ac.selective_ac_option)}.get(ac.mode, ac.mode)
    if ac.mode == "full" and ac.blocks is not None:
        mode = f"{FIRST}{ac.blocks}"
    pipelined = config.parallelism.pipeline_parallel_degree > 1
    reshard = {"default": not pipelined, "always": True, "never": False}[config.parallelism.fsdp_reshard_after_forward]
    return Layout(ac=mode, reshard=reshard, offload=config.training.enable_cpu_offload,
                  host_optimizer=config.optimizer.on_host, park_inputs=ac.offload, stream=config.memory.stream_weights)


# the layout's fields and the settings that give each: a job that gives one (job file or command line) keeps it
LAYOUT_SETTINGS = {
    "ac": ("activation_checkpoint.mode", "activation_checkpoint.selective_ac_option", "activation_checkpoint.blocks"),
    "reshard": ("parallelism.fsdp_reshard_after_forward",),
    "offload": ("training.enable_cpu_offload",),
    "host_optimizer": ("optimizer.on_host",),
    "park_inputs": ("activation_checkpoint.offload",),
    "stream": ("memory.stream_weights",),
    "micro_batches": ("training.gradient_accumulation_steps",),
}


def fixed_settings(config, given: dict[str, int]) -> set[str]:
    """The layout's fields the job gives itself (job file or command line), which the plan keeps."""
    fixed = {field for field, settings in LAYOUT_SETTINGS.items() if set(settings) & set(given)}
    # a pipeline schedule splits the batch itself; one varlen row cannot be split without changing the data
    if config.parallelism.pipeline_parallel_degree > 1:
        fixed.add("micro_batches")
    return fixed


def kept_settings(given: dict[str, int], fitting: Callable[[], Plan]) -> str:
    """For a refused job that gives layout settings itself: the remedy of leaving them out where the plan then fits
    (``fitting``: the plan without them), else ""."""
    flags = [f"--{setting}" for settings in LAYOUT_SETTINGS.values() for setting in settings if setting in given]
    if not flags or not (plan := fitting()).fits:
        return ""
    return (f"; or leave {', '.join(flags)} out of the job file and the command line: the plan keeps what the job "
            f"gives, and without it fits the job ({plan.layout.describe()})")


# Under the memory plan, CUDA's caching allocator grows its segments in place instead of reserving fixed
# blocks: what it reserves then follows what the tensors take more closely (docs/perf-log.md, 2026-11-27), and
# the plan's margin for fragmentation shrinks to match. A PYTORCH_CUDA_ALLOC_CONF of the user's own is left as it is.
PLANNED_ALLOCATOR = "expandable_segments:True"


def expandable_segments(config) -> bool:
    """Whether the job's CUDA allocator grows its segments in place: the user's setting says so, or the plan sets it."""
    own = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if own is None:
        return device.CUDA and config.memory.plan == "auto"
    return "expandable_segments:true" in own.replace(" ", "").lower()


def apply(config, world_size: int, given: dict[str, int], model_config=None,
          meta: Callable[[], nn.Module] | None = None) -> None:
    """Plan the job and set what the plan changes; refuse, in one line, a job that fits no plan.

    ``model_config``, ``meta``: the job's, as flame.prepare read and built them (see ``job_of``).
    """
    m = config.memory
    budget_given = any(f"memory.{flag}" in given for flag in ("gpu_budget_gib", "host_budget_gib"))
    if budget_given and "memory.plan" not in given:
        m.plan = "auto"  # a budget says "fit the job into this": the plan is what does that
    if m.plan == "off":
        for flag in ("gpu_budget_gib", "host_budget_gib"):
            if f"memory.{flag}" in given:
                raise ConfigError(f"--memory.{flag} is a budget for the memory plan, and --memory.plan is off: "
                                  "drop one of them")
        return
    if device.CUDA:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", PLANNED_ALLOCATOR)  # before this process starts CUDA
    gpu, host = budgets(config)
    announce = os.environ.get("RANK") == "0"  # a torchrun rank 0: the preflight and the other ranks stay quiet
    if gpu is None and not announce:
        return  # a CPU run without a budget: nothing to fit, the estimate is only shown
    try:
        job = job_of(config, world_size, model_config, meta)
    except Exception as error:  # noqa: BLE001 - without a budget the estimate is only shown; it must not stop a run
        if gpu is not None:
            raise
        logger.warning(f"Memory plan: no estimate for this model ({type(error).__name__}: {error}); nothing changed")
        return
    from flame.memory import (
        hardware,  # `python -m flame.memory.hardware` runs it: not imported with the package
    )

    rates = lambda: hardware.load(device.compute_dtype(config))  # noqa: E731
    plan = choose(job, layout_of(config), fixed_settings(config, given), gpu, host, rates=rates)
    if not plan.fits:
        raise ConfigError(
            f"the job does not fit the {gpu / GIB:.2f} GiB GPU budget even with {plan.layout.describe()} "
            f"(the most memory-saving plan that keeps the settings given): that needs --memory.gpu_budget_gib {math.ceil(plan.gpu_bytes / GIB * 100) / 100:.2f}; "
            "use more GPUs (FSDP), a shorter --training.seq_len or fewer --training.batch_size rows"
            + plan.remark
            + kept_settings(given, lambda: choose(job, Layout(reshard=config.parallelism.pipeline_parallel_degree <= 1),
                                                  fixed_settings(config, {}), gpu, host, rates=rates))
        )
    set_layout(config, plan.start, plan.layout)
    if announce:
        peak = "" if device.CUDA else "\nmeasured peak: not measurable on CPU (no device memory)"
        logger.info(f"Memory plan (--memory.plan auto; docs/memory-plan.md):\n{table(plan, as_run(job, plan.layout).activations.method)}{peak}")


def set_layout(config, start: Layout, layout: Layout) -> None:
    """Write the plan's changes into the job config (only what differs from how the job started)."""
    if layout.ac != start.ac:
        ac = config.activation_checkpoint
        whole = layout.ac in ("none", "full", "memory_budget")  # else op, or every N-th block: torchtitan's selective
        ac.mode, ac.selective_ac_option = (layout.ac, ac.selective_ac_option) if whole else ("selective", layout.ac)
        if (count := first_blocks(layout.ac)) is not None:
            ac.mode, ac.blocks = "full", count
    if layout.reshard != start.reshard:
        config.parallelism.fsdp_reshard_after_forward = "always" if layout.reshard else "never"
    if layout.offload != start.offload:
        config.training.enable_cpu_offload = True
    if layout.host_optimizer != start.host_optimizer:
        config.optimizer.on_host = True
    if layout.park_inputs != start.park_inputs:
        config.activation_checkpoint.offload = True
    if layout.stream != start.stream:
        config.memory.stream_weights = True
    if layout.micro_batches > 1:
        config.training.local_batch_size //= layout.micro_batches
        config.training.gradient_accumulation_steps *= layout.micro_batches


def check_same_plan(config) -> None:
    """Every rank took the same plan, or all of them stop here, in one line, before the first step.

    Ranks that planned apart (the nodes of a job measured their rates apart, and a layout priced
    near another flipped) would run different micro-batch counts and wait on each other's
    collectives forever. One all-gather of each rank's settings at the start rules that out.
    """
    import torch.distributed as dist

    from flame.memory import hardware

    ac, t = config.activation_checkpoint, config.training
    mine = {"activation_checkpoint.mode": ac.mode, "activation_checkpoint.selective_ac_option": ac.selective_ac_option,
            "activation_checkpoint.blocks": ac.blocks,
            "parallelism.fsdp_reshard_after_forward": config.parallelism.fsdp_reshard_after_forward,
            "training.enable_cpu_offload": t.enable_cpu_offload, "optimizer.on_host": config.optimizer.on_host,
            "memory.stream_weights": config.memory.stream_weights,
            "training.local_batch_size": t.local_batch_size,
            "training.gradient_accumulation_steps": t.gradient_accumulation_steps}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    apart = next((rank for rank, settings in enumerate(every) if settings != every[0]), None)
    if apart is not None:
        differ = [flag for flag in mine if every[apart][flag] != every[0][flag]]
        shown = ", ".join(f"--{flag} {every[0][flag]} on rank 0, {every[apart][flag]} on rank {apart}" for flag in differ)
        rates = hardware.cache_path(device.compute_dtype(config)).parent
        raise ConfigError(
            f"the memory plan differs between ranks ({shown}), as when nodes measure their hardware apart: set "
            f"FLAME_HARDWARE on every node to one node's rates file ({rates}), or give those settings yourself")


def planned_gpu_gib(config, world_size: int) -> float:
    """The estimate of the job as it now stands (the plan applied): the trainer logs it beside the measured peak."""
    return gpu_bytes(estimate(job_of(config, world_size), layout_of(config))) / GIB
