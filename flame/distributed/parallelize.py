"""Tensor parallelism, activation checkpointing, torch.compile and FSDP2/DDP for any HF/fla causal LM.

The one thing flame needs to know about a model is where its decoder blocks are; the
stack is found generically (the ModuleList holding most parameters), so any HF model that
keeps its blocks in a ModuleList works without a model-specific entry (tensor parallelism
needs a plan per model_type: flame.distributed.tensor_parallel). Order follows torchtitan: TP
shards the blocks, AC wraps each block, compile wraps each (wrapped) block, FSDP shards (or
DDP replicates) last.
"""

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flame import compat

from flame.base import device
from flame.distributed import degrees
from flame.distributed.activation_offload import offload_inputs
from flame.distributed.expert_parallel import apply_expert_parallel, expert_shard_placement
from flame.distributed.tensor_parallel import apply_tensor_parallel
from flame.base.errors import ConfigError
from flame.models import float8, lora
from flame.models.experts import experts_modules
from flame.models.registry import decoder_layers
from flame.models.support import support_for


def _wrap_blocks(layers: nn.ModuleList, wrap) -> None:
    for index, block in enumerate(list(layers)):
        layers[index] = wrap(index, block)


def checkpoint_blocks(layers: nn.ModuleList, ac_config, model_compile_enabled: bool) -> None:
    """Wrap each decoder block in activation checkpointing (full, or selective per-N-blocks / op-level); with
    --activation_checkpoint.blocks N, only the first N in full AC."""
    count = len(layers) if ac_config.blocks is None else ac_config.blocks
    if count > len(layers):
        raise ConfigError(f"--activation_checkpoint.blocks {count}: the model has {len(layers)} decoder blocks; give at "
                          f"most {len(layers)}, or leave it unset to checkpoint them all")
    _wrap_blocks(
        layers,
        lambda index, block: compat.torchtitan.checkpoint_block(
            block, ac_config, base_fqn=f"layers.{index}", model_compile_enabled=model_compile_enabled
        ) if index < count else block,
    )
    which = f"the first {count} of {len(layers)}" if count < len(layers) else str(count)
    logger.info(f"Applied {ac_config.mode} activation checkpointing to {which} blocks")


def parallelize_model(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    if parallel_dims.tp_enabled:  # first, on the unwrapped blocks (flame.distributed.tensor_parallel)
        apply_tensor_parallel(model, parallel_dims.get_mesh("tp"), job_config)
    if parallel_dims.ep_enabled:  # likewise (flame.distributed.expert_parallel)
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    dtype = degrees.frozen_weights_dtype(job_config, parallel_dims.world_size)
    if lora.LoraSettings.of(job_config.lora) is not None and dtype != torch.float32:
        held = lora.hold_base_in(model, dtype)
        logger.info(f"LoRA: the frozen base's {held:,} weights held in {str(dtype).removeprefix('torch.')}, the "
                    "dtype its matmuls read them in (they have no gradient or optimizer state)")
    support = support_for(model.config)
    compile_blocks = job_config.compile.enable and "model" in job_config.compile.components
    if (fp8 := float8.Float8Settings.of(job_config.float8)) is not None:  # before AC and compile wrap the blocks
        t = job_config.training
        tokens = t.local_batch_size * t.seq_len // job_config.parallelism.context_parallel_degree
        compiled = (float8.EAGER if not compile_blocks else float8.LAYERS if support.stays_eager else float8.BLOCKS)
        logger.info(float8.convert(model, fp8, tokens, compiled, fsdp=parallel_dims.fsdp_enabled,
                                   backend=job_config.compile.backend))
    layers = decoder_layers(model)
    ac_config = job_config.activation_checkpoint
    if ac_config.mode == "memory_budget":  # the compiler chooses what compiled blocks recompute
        if not job_config.compile.enable:
            raise ConfigError("--activation_checkpoint.mode memory_budget needs --compile.enable (--training.compile)")
        if support.stays_eager:
            raise ConfigError(
                f"--activation_checkpoint.mode memory_budget needs compiled blocks, and {support.name}'s stay eager "
                f"({support.stays_eager}); use --activation_checkpoint.mode full or selective"
            )
    if ac_config.mode in ("full", "selective"):
        checkpoint_blocks(layers, ac_config, job_config.compile.enable)
    elif ac_config.mode == "memory_budget":
        torch._functorch.config.activation_memory_budget = ac_config.memory_budget

    if compile_blocks:
        if support.stays_eager:  # the flag helps or does nothing: never a slower run
            logger.info(f"--training.compile: {support.name}'s decoder blocks stay eager ({support.stays_eager})")
        else:
            backend = job_config.compile.backend
            _wrap_blocks(layers, lambda index, block: torch.compile(block, backend=backend))
            logger.info(f"Compiling each of the {len(layers)} decoder blocks with torch.compile")

    if ac_config.offload:  # the checkpointed blocks' inputs (flame.distributed.activation_offload)
        offload_inputs(layers, len(layers) if ac_config.blocks is None else ac_config.blocks)
    if job_config.memory.stream_weights:  # the optimizer's builder streams it (flame.optim.streaming)
        materialize_on_host(model, StreamedDtypes(device.compute_dtype(job_config),
                                                  TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]))
    elif parallel_dims.fsdp_enabled:
        replicas = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
        experts_mesh = parallel_dims.get_mesh([*replicas, "efsdp"]) if parallel_dims.ep_enabled else None
        apply_fsdp(model, layers, parallel_dims.get_mesh([*replicas, "fsdp"]), job_config, experts_mesh)
    elif parallel_dims.dp_replicate_enabled:  # replicate only (config_manager refuses it with TP/PP)
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
    elif degrees.fsdp_alone(job_config, parallel_dims.world_size):
        # torchtitan builds no mesh of size 1; FSDP over one rank shards nothing: its CPUOffloadPolicy keeps the
        # weights, gradients and optimizer state on the host, and its mixed precision casts a block at a time
        mesh = init_device_mesh(device.TYPE, (1,), mesh_dim_names=("fsdp",))
        apply_fsdp(model, layers, mesh, job_config)
    return model


STREAMED_IN = "flame_streamed_in"  # a streamed model's attribute: its StreamedDtypes


class StreamedDtypes(NamedTuple):
    compute: torch.dtype  # what the weights visit the GPU in
    reduce: torch.dtype  # what several processes sum the gradients in (--training.mixed_precision_reduce)


def materialize_on_host(model: nn.Module, dtypes: StreamedDtypes) -> None:
    """Have torchtitan materialize and initialize ``model``'s weights on the host, whatever device it names: a
    streamed model's weights live there (torchtitan does so only for FSDP's CPU offload, which streaming is not),
    and mark it for the optimizer's builder, which streams it. Each process initializes the whole model (from the
    seed every rank shares) and keeps its shards."""
    model.to_empty = lambda *, device, recurse=True: nn.Module.to_empty(model, device="cpu", recurse=recurse)
    setattr(model, STREAMED_IN, dtypes)


def apply_fsdp(model: nn.Module, layers: nn.ModuleList, mesh, job_config: JobConfig, experts_mesh=None) -> None:
    """Shard each decoder block, the untied embeddings, and the rest (norm, lm_head) at the root; under expert
    parallelism each MoE layer's experts first, over ``experts_mesh`` (the ranks holding the same experts)."""
    training = job_config.training
    policy = MixedPrecisionPolicy(
        param_dtype=device.compute_dtype(job_config),
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    options = {"mesh": mesh, "mp_policy": policy}
    if training.enable_cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.CUDA)  # pinned for asynchronous copies to a GPU
    # default: reshard after forward, except under pipeline parallelism, whose microbatches would
    # all-gather the same weights again for every forward (torchtitan's policy)
    pipelined = job_config.parallelism.pipeline_parallel_degree > 1
    reshard = {"default": not pipelined, "always": True, "never": False}[job_config.parallelism.fsdp_reshard_after_forward]

    if experts_mesh is not None:
        ranks = experts_mesh.size()
        for module in experts_modules(model):
            fully_shard(module, **{**options, "mesh": experts_mesh}, reshard_after_forward=reshard,
                        shard_placement_fn=lambda param: expert_shard_placement(param, ranks))
    for block in layers:
        fully_shard(block, **options, reshard_after_forward=reshard)
    if training.enable_cpu_offload:  # each block's weights come over the host link: copy the next one's meanwhile
        for block, following in zip(layers, list(layers)[1:]):
            block.set_modules_to_forward_prefetch([following])
    embeddings = model.get_input_embeddings()  # None on pipeline stages after the first
    output_weight = getattr(model.get_output_embeddings(), "weight", None)
    if embeddings is not None and output_weight is not embeddings.weight:
        fully_shard(embeddings, **options, reshard_after_forward=reshard)
    fully_shard(model, **options)
    # flame normalizes the loss by the global token count; FSDP must sum, not average.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(not device.COLLECTIVES_SCALE_IN_REDUCTION)
    shape = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    logger.info(f"Applied FSDP2 over {mesh.size()} ranks ({shape}) to {len(layers)} blocks")


def apply_ddp(model: nn.Module, mesh) -> None:
    """Replicate the model (torch's composable DDP): every rank holds all weights, gradients are all-reduced.

    Parameters and gradients stay in fp32 (the all-reduce too: torchtitan's only
    --training.mixed_precision_reduce); on GPU torchtitan's trainer runs the forward under
    autocast in --training.mixed_precision_param, as for a single GPU.
    """
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    # flame's loss is already divided by the global token count, so replicas must sum their
    # gradients; DDP averages. DDP also reduces the accumulated .grad at every micro-batch's
    # backward, so a summing comm hook would count earlier micro-batches again: scale each new
    # gradient by the replica count instead (before it is accumulated), and the average is the sum.
    replicas = mesh.size()

    def scale_new_gradients(module: nn.Module, args) -> None:  # once, on the materialized parameters
        hook.remove()
        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(lambda grad: grad * replicas)

    hook = model.register_forward_pre_hook(scale_new_gradients)
    logger.info(f"Applied DDP over {replicas} ranks")
