"""What the memory plan knows of a job, and the settings it may change in it (a ``Layout``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flame.memory.activations import ActivationProfile
    from flame.optim.record import OptimizerRecord

FIRST = "first:"  # Layout.ac "first:K": full AC of the first K blocks only (--activation_checkpoint.blocks K)


def first_blocks(ac: str) -> int | None:
    """K of a ``first:K`` setting (full AC of the first K blocks), else None."""
    return int(ac[len(FIRST):]) if ac.startswith(FIRST) else None


def describe_ac(ac: str) -> str:
    """A ``Layout.ac`` setting in words."""
    if (count := first_blocks(ac)) is not None:
        return f"full AC of the first {count} blocks" if count > 1 else "full AC of the first block"
    return {"none": "no AC", "full": "full AC", "op": "op-level selective AC",
            "memory_budget": "compiler-chosen AC (memory_budget)"}.get(ac, f"selective AC every {ac} blocks")


@dataclass(frozen=True)
class Layout:
    """The settings the plan may change."""

    # none, full, first:K (full AC of the first K blocks), op (op-level selective), every-N (selective, an int N),
    # memory_budget
    ac: str = "none"
    reshard: bool = True  # FSDP frees each block's gathered weights after its forward
    offload: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host
    micro_batches: int = 1  # the rows of training.batch_size split over this many accumulation steps
    host_optimizer: bool = False  # --optimizer.on_host: the optimizer state on the host, stepped there
    park_inputs: bool = False  # --activation_checkpoint.offload: the checkpointed blocks' inputs on the host
    stream: bool = False  # --memory.stream_weights: the weights on the host, each block's streamed to the GPU as it runs

    def describe(self) -> str:
        parts = [describe_ac(self.ac)]
        if self.stream:
            parts.append("weights streamed from the host")
        if not self.reshard:
            parts.append("weights kept gathered")
        if self.offload:
            parts.append("CPU offload")
        if self.host_optimizer:
            parts.append("optimizer on the host")
        if self.park_inputs:
            parts.append("checkpointed inputs on the host")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        return ", ".join(parts)


@dataclass(frozen=True)
class Job:
    """What the estimate needs to know about the job, apart from the layout the plan changes."""

    params: int  # every parameter of the model
    matrix_params: int  # the decoder blocks' 2-D weights (what Muon updates)
    block_params: int  # the largest decoder block's parameters
    vocab_size: int
    hidden_size: int
    compute_bytes: int  # bytes per element of the compute dtype
    hidden_bytes: int  # bytes per element of the residual stream: float32 under autocast, else the compute dtype
    optimizer: OptimizerRecord  # its state's bytes and whether it offloads (flame.optim.record)
    rows: int  # training.batch_size (per rank, before any split into micro-batches)
    accumulates: bool  # the job's own gradient accumulation: gradients live through every forward
    tokens_per_row: int  # seq_len over the context-parallel degree
    weight_shards: int  # FSDP shards x tensor- and pipeline-parallel degree
    fsdp: bool
    alone: bool  # FSDP over this process's one rank (flame.distributed.degrees.fsdp_alone): no other rank to talk to
    can_offload: bool  # a GPU job under FSDP, or of one process (FSDP wraps it alone to offload it)
    can_step_on_host: bool  # a GPU job, not pipelined, whose optimizer steps on the host (--optimizer.on_host)
    gpu_state_params: int  # under --optimizer.on_host, the parameters whose state --optimizer.gpu_blocks keeps on the GPU
    autocast_copies: bool  # no FSDP and a bf16/fp16 compute dtype: autocast keeps a cast copy of each weight
    fused_loss: bool
    expandable_segments: bool  # PyTorch's allocator grows segments in place: little fragmentation
    dense_attention: bool  # sdpa keeps the T x T weights; flash-style kernels do not
    tensor_parallel: int
    pipelined: bool  # stages split the blocks: AC of the first K blocks is not offered
    ema: bool  # an average of the weights beside them (--training.ema_decay): fp32, placed like the weights
    activations: ActivationProfile = field(repr=False)
    # one process, no FSDP: the job as it runs once CPU offload or the optimizer on the host wraps it in FSDP over
    # a one-rank mesh (flame.distributed.degrees.fsdp_alone), its activations measured again without autocast;
    # built when a layout asks for it
    wrapped: Callable[[], Job] | None = field(default=None, repr=False, compare=False)
    # the parameters a token's forward multiplies, where fewer than ``params``: a mixture of experts' active ones
    active_params: int | None = None
    can_park_inputs: bool = False  # a GPU job, not pipelined: checkpointed inputs may wait on the host
    # LoRA (flame.models.lora): the frozen base's parameters, without gradients or optimizer state, and the bytes
    # each is held in (the compute dtype's under mixed precision: lora.hold_base_in)
    frozen_params: int = 0
    frozen_bytes: int = 4
    # pinned host memory over what it holds (flame.optim.pinned): FSDP's CPU offload pins each weight shard and
    # each gradient, rounded up to a power of two by PyTorch's allocator; the host optimizer's own copies come from
    # chunks, which lose only their tails
    offload_pinning: float = 1.0
    host_copy_pinning: float = 1.0
    # --memory.stream_weights may run it (flame.optim.streaming): a GPU job, data parallel only (each rank streams its
    # shard), stepped by AdamW or Adam, none of EMA, FP8 or compiled blocks (LoRA: its frozen base in its own dtype)
    can_stream: bool = False
    resident_params: int = 0  # the parameters outside the decoder blocks (embeddings, final norm, head)
    stream_pinning: float = 1.0  # streamed, the pinned arena's bytes over what its masters and landings hold

    @property
    def computed_params(self) -> int:
        """The parameters whose matmuls a token's forward runs (all of them, but a MoE's experts: top_k of them)."""
        return self.active_params if self.active_params is not None else self.params

    @property
    def trainable_params(self) -> int:
        """The parameters with gradients and optimizer state (LoRA: its adapters)."""
        return self.params - self.frozen_params

    def weight_bytes(self) -> float:
        """Every parameter's bytes where it is held: float32 trained weights, the frozen ones in their own dtype."""
        return 4 * self.trainable_params + self.frozen_bytes * self.frozen_params


def as_run(job: Job, layout: Layout) -> Job:
    """``job`` as ``layout`` runs it: under FSDP over its one rank when the layout offloads or steps on the host;
    streamed, without autocast (the weights come in the compute dtype), as FSDP's mixed precision runs it."""
    if job.wrapped is not None and (layout.offload or layout.host_optimizer):
        return job.wrapped()
    if job.wrapped is not None and layout.stream:
        return dataclasses.replace(job.wrapped(), fsdp=False, alone=False)
    return job


def count_params(model: nn.Module, blocks: nn.ModuleList) -> tuple[int, int, int]:
    """(all parameters, the blocks' matrices, the largest block's parameters), tied weights once."""
    total = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in blocks.parameters() if p.dim() == 2)
    largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    return total, matrices, largest


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()
