"""Sizes no machine can run, refused before anything is built: rows and batches beyond what the kernels can index
or the memory they live in can hold, a model whose training state cannot fit, more ranks on a host than it has
GPUs (or, CPU-only, cores).

Every memory bound is a floor, not an estimate (that is the memory plan's, flame.memory): it counts only what a
step cannot do without, so a job it refuses could not have run, whatever layout or plan it took. Each refusal
names the limit that applies and the setting to change.

    check_batch(config, world_size)             before the memory plan (which splits batches into micro-batches
                                                and would weigh every split of an absurd one)
    check_memory(config, world_size, model)     once the plan is applied, after the model's own checks
    check_processes(world_size)                 train.sh's preflight: the processes it is about to start
"""

import math
import os
from typing import Any

import torch

from flame.base import device
from flame.base.errors import ConfigError
from flame.distributed.degrees import data_parallel_degree, fsdp_enabled, frozen_weights_dtype
from flame.memory.estimate import GIB
from flame.memory.layout import count_params, dtype_bytes
from flame.models.kernels.attention import backend_for
from flame.models.registry import decoder_layers
from flame.models.support import Documents, support_for
from flame.optim.record import optimizer_record
from flame.prepare.model import ModelUnderCheck

# a micro-batch's document offsets (cu_seqlens, flame.data.packing), which the attention kernels read, are int32
MAX_BATCH_TOKENS = 2**31 - 1
# a step's batch on the host, per token: input ids, labels and position ids, int64 each; every micro-batch of a
# step is read before the first computes (the step's target count divides its loss)
BATCH_BYTES_PER_TOKEN = 3 * 8
# fp32 weights and their fp32 gradients, per parameter trained (the optimizer's state comes on top)
WEIGHT_AND_GRADIENT_BYTES = 8
# the dense reference attention (--model.attention sdpa; auto's choice on a CPU): each row's tokens x tokens table of
# its documents, kept for the step (a bool an entry), and the float copy of it that each attention call makes and
# keeps for its backward (4 bytes an entry; measured on torch's CPU kernel)
MASK_BYTES, FLOAT_MASK_BYTES = 1, 4


def check_batch(config: Any, world_size: int) -> None:
    """Rows and micro-batches the kernels can index, and a step's batch that fits the host's memory."""
    t = config.training
    rows, tokens = t.local_batch_size, t.local_batch_size * t.seq_len
    offsets = (f"{MAX_BATCH_TOKENS:,} tokens, the most a micro-batch can hold: its document offsets, which the "
               "attention kernels read, are 32-bit")
    if t.seq_len > MAX_BATCH_TOKENS:
        raise ConfigError(f"--training.seq_len {t.seq_len} is beyond {offsets}; lower --training.seq_len")
    if tokens > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"--training.batch_size {rows} rows of --training.seq_len {t.seq_len} are {tokens:,} tokens a "
            f"micro-batch, beyond {offsets}; lower --training.batch_size to at most {MAX_BATCH_TOKENS // t.seq_len:,}, "
            "and raise --training.gradient_accumulation_steps to keep the global batch"
        )
    accumulated = t.gradient_accumulation_steps
    step = tokens * accumulated * BATCH_BYTES_PER_TOKEN
    memory, where = _host_share(world_size)
    if step > memory:
        micro = f" in each of {accumulated} micro-batches" if accumulated > 1 else ""
        raise ConfigError(
            f"--training.batch_size {rows} rows of --training.seq_len {t.seq_len} tokens{micro} hold "
            f"{_gib(step)} of token ids, labels and positions ({BATCH_BYTES_PER_TOKEN} bytes a token) on the host "
            f"every step, more than {where}; lower --training.batch_size"
            f"{', --training.gradient_accumulation_steps' if accumulated > 1 else ''} or --training.seq_len"
        )


def check_memory(config: Any, world_size: int, model: ModelUnderCheck) -> None:
    """A row, a micro-batch and the model's training state that fit the memory they live in: the GPU's, or on a
    CPU run the host's (shared by its ranks)."""
    memory, where = _rank_memory(world_size)
    if memory is None:
        return
    t, p = config.training, config.parallelism
    blocks = len(decoder_layers(model.meta))
    hidden, vocab = getattr(model.config, "hidden_size", 0), getattr(model.config, "vocab_size", 0)
    # each block's input is kept for the backward, even when full activation checkpointing recomputes the rest;
    # without the fused loss, every token's logits exist at once. Tensor parallelism may shard both, context
    # parallelism splits the rows' tokens, pipeline stages split the blocks.
    fused = device.fused_cross_entropy_enabled(config, vocab)
    stage_blocks = blocks // p.pipeline_parallel_degree or 1
    per_token = (stage_blocks * hidden + (0 if fused else vocab)) \
        * dtype_bytes(device.compute_dtype(config)) / p.tensor_parallel_degree
    local = t.seq_len / p.context_parallel_degree  # the row's tokens this rank computes
    masks = dense_masks_kept(config, model, stage_blocks)
    mask_bytes = MASK_BYTES + FLOAT_MASK_BYTES * masks if masks else 0  # an entry of a row's masks
    row = local * (per_token + mask_bytes * t.seq_len)  # a mask's row: every key
    logits = "" if fused else f" and its logits ({vocab} a token)"
    mask = (f", and its dense attention masks ({local:,.0f} x {t.seq_len:,} entries: the documents' table, a byte an "
            f"entry, and the float copy each attention call keeps for its backward, {FLOAT_MASK_BYTES} bytes an entry, "
            f"in {masks} block{'s' if masks > 1 else ''} at once; --model.attention sdpa, a CPU's attention: GPUs' "
            "varlen kernel keeps none)" if masks else "")
    kept = f"each of its {blocks} blocks' inputs ({hidden} values a token){logits}{mask}"
    if row > memory:
        # local x per_token + b x local² <= memory (a mask's keys = cp x local), solved for the local tokens
        a, b = per_token, mask_bytes * p.context_parallel_degree
        fits = int((memory / a if not b else (math.sqrt(a * a + 4 * b * memory) - a) / (2 * b)) * p.context_parallel_degree)
        split = ", or split rows over more GPUs (--parallelism.context_parallel_degree)" if device.CUDA else ""
        even = ", even under full activation checkpointing" if masks <= 1 else ""
        raise ConfigError(
            f"--training.seq_len {t.seq_len}: one row keeps at least {_gib(row)} of activations ({kept}{even}), more "
            f"than {where}; at most about {fits:,} tokens a row fit: lower --training.seq_len{split}{_one_mask(masks)}"
        )
    if row * t.local_batch_size > memory:
        raise ConfigError(
            f"--training.batch_size {t.local_batch_size} rows of --training.seq_len {t.seq_len} keep at least "
            f"{_gib(row * t.local_batch_size)} of activations ({kept}), more than {where}; at most "
            f"{int(memory // row):,} rows fit: lower --training.batch_size, and raise "
            f"--training.gradient_accumulation_steps to keep the global batch{_one_mask(masks)}"
        )
    _check_training_state(config, world_size, model, memory, where)


def _one_mask(masks: int) -> str:
    return "; or --activation_checkpoint.mode full, which keeps one block's mask at a time" if masks > 1 else ""


def dense_masks_kept(config: Any, model: ModelUnderCheck, blocks: int) -> int:
    """How many float attention masks (tokens x tokens) a step keeps at once: 0 unless the model's softmax attention
    takes flame's dense reference path; one per block without activation checkpointing, else one (a recomputed
    block's alone; blocks not checkpointed under some AC modes keep theirs, so this is a floor)."""
    dense = backend_for(config.model.attention, cuda=device.CUDA) == "sdpa"
    if not dense or support_for(model.config).documents is not Documents.ATTENTION:
        return 0
    return blocks if config.activation_checkpoint.mode == "none" else 1


def _check_training_state(config: Any, world_size: int, model: ModelUnderCheck, memory: float, where: str) -> None:
    """Weights, gradients and optimizer state, sharded as the layout shards them, where they live."""
    if device.CUDA and (config.memory.plan == "auto" or config.training.enable_cpu_offload
                        or config.memory.stream_weights):
        return  # the plan may move them to the host; offload and streaming have
    params, matrices, _ = count_params(model.meta, decoder_layers(model.meta))
    record = optimizer_record(config.optimizer.name)
    if config.lora.rank is not None:  # frozen base weights: no gradients, no optimizer state
        held = dtype_bytes(frozen_weights_dtype(config, world_size))
        per_param, state = float(held), f"{'fp32' if held == 4 else 'compute-dtype'} weights, frozen under LoRA"
    else:
        on_host = device.CUDA and config.optimizer.on_host  # its state then lives on the host
        optimizer = 0 if on_host else record.state_of(params, matrices) / params
        per_param = WEIGHT_AND_GRADIENT_BYTES + optimizer
        state = f"fp32 weights and gradients{'' if on_host else f' and {record.name} state ({record.state})'}"
    p = config.parallelism
    shards = p.tensor_parallel_degree * p.pipeline_parallel_degree
    if fsdp_enabled(config, world_size):
        fsdp = data_parallel_degree(config, world_size) // p.data_parallel_replicate_degree
        shards *= fsdp * p.context_parallel_degree
    need = params * per_param / shards
    if need <= memory:
        return
    fix = ("train it on GPUs, or pick a smaller --model.config (e.g. configs/llama_4M.json)" if not device.CUDA else
           "shard it over more GPUs (FSDP), offload it (--memory.stream_weights; --training.enable_cpu_offload, "
           "--optimizer.on_host) or let "
           "--memory.plan auto choose")
    raise ConfigError(
        f"the model's {params / 1e9:.3g}B parameters need at least {_gib(need)} a rank for their training state "
        f"({state}, {per_param:g} bytes a parameter{f', over {shards} shards' if shards > 1 else ''}), more than "
        f"{where}; {fix}"
    )


def check_processes(world_size: int) -> None:
    """Each rank takes a GPU of its own (torchtitan picks its LOCAL_RANK's), or on a CPU-only host a core: no more of
    them on this host than it has."""
    ranks = local_ranks(world_size)
    if device.CUDA:
        if 0 < (gpus := torch.cuda.device_count()) < ranks:  # none visible: a launcher node without GPUs
            raise ConfigError(f"{ranks} ranks (NGPU) on this host, which has {gpus} GPUs: each rank takes the GPU of "
                              f"its local rank; set NGPU to at most {gpus}, or spread the job over more nodes (NNODE)")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if ranks > cores:
        raise ConfigError(
            f"{ranks} ranks (NGPU) on this CPU-only host, which has {cores} cores: each rank needs a core of its own "
            f"(a rank waiting for a core stalls every collective of the others); set NGPU to at most {cores}, or spread "
            "the job over more nodes (NNODE)"
        )


def local_ranks(world_size: int) -> int:
    """The ranks of this job on this host: torchrun's LOCAL_WORLD_SIZE on a rank, train.sh's NGPU (or the job over
    NNODE nodes) in its preflight."""
    for name in ("LOCAL_WORLD_SIZE", "NGPU"):
        if (value := os.environ.get(name, "")).isdigit() and int(value) > 0:
            return int(value)
    nodes = os.environ.get("NNODE", "")
    return max(1, world_size // int(nodes)) if nodes.isdigit() and int(nodes) > 0 else world_size


def host_memory() -> float:
    """This host's physical memory, in bytes."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _rank_memory(world_size: int) -> tuple[float | None, str]:
    """(bytes one rank's tensors may take at most, the memory in words): its GPU's, or its share of a CPU host's;
    None where no GPU can be read (a launcher node without one)."""
    if not device.CUDA:
        return _host_share(world_size)
    if not (count := torch.cuda.device_count()):
        return None, ""
    local = int(os.environ.get("LOCAL_RANK", "0")) % count
    memory = torch.cuda.get_device_properties(local).total_memory
    return float(memory), f"the {_gib(memory)} of GPU {local}"


def _host_share(world_size: int) -> tuple[float, str]:
    """(bytes of host memory one rank may take at most, in words): this host's memory over its ranks."""
    ranks, memory = local_ranks(world_size), host_memory()
    share = f", shared by its {ranks} ranks ({_gib(memory / ranks)} each)" if ranks > 1 else ""
    return memory / ranks, f"this host's {_gib(memory)}{share}"


def _gib(size: float) -> str:
    return f"{size / GIB:,.1f} GiB" if size < 10 * 1024 * GIB else f"{size / GIB / 1024:,.0f} TiB"
