"""What a layout costs a step, in seconds, from this machine's measured rates (``flame.memory.hardware``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flame.memory.layout import Job, Layout, as_run, first_blocks
from flame.memory.estimate import parked_input_bytes

if TYPE_CHECKING:
    from flame.memory.hardware import Hardware

# Calibrated on an H100 with HF llama 340M, eager, 32K tokens a step in 1 or 2 passes (docs/perf-log.md,
# 2026-11-27): the 6N matmuls took this share of a pass's GPU time (0.096 of 0.179 s) ...
MATMUL_SHARE = 0.54
# ... and the host's time per pass (0.076 s over 24 blocks) was this many of the probe's launches
# (6.4 us there) per decoder block, forward and backward
LAUNCHES_PER_BLOCK_PASS = 500
# --optimizer.on_host, calibrated on an H100 (fla transformer 1B, one row of 32K tokens): the host's AdamW
# took 0.243-0.267 s a step beside the loop against 0.194 s at the probe's rate, and the next forward
# (priced 0.191 s) hid 0.115-0.121 s of it
HOST_STEP_SLOWDOWN = 1.3
FORWARD_HIDES = 0.6
INTERCONNECT_GBPS = 100.0  # FSDP's gathers between GPUs (NVLink-class): not measured; only orders layouts that gather more


@dataclass(frozen=True)
class Price:
    """What one optimizer step costs on one rank under a layout, in seconds (docs/memory-plan.md)."""

    compute: float  # the passes' forwards and backwards: the GPU's work plus the host's launches
    recompute: float  # the forwards activation checkpointing runs again
    gathers: float  # FSDP's all-gathers of the weights, per micro-batch (once more in the backward when resharded)
    offload: float  # CPU offload: the weights up and the gradients down over the host link, and the host's AdamW step;
    # with the optimizer on the host, what of its step the next forward does not hide

    @property
    def seconds(self) -> float:
        return self.compute + self.recompute + self.gathers + self.offload


def price(job: Job, layout: Layout, hardware: Hardware) -> Price:
    """The time a layout costs, from this machine's measured rates.

    A pass (one micro-batch's forward and backward) takes its GPU time plus its host time. The
    GPU runs the forward's matmuls (``2 x parameters x tokens`` FLOPs per tensor-parallel shard; a mixture of
    experts' active parameters),
    the backward's (twice that), and the rest of the step (``MATMUL_SHARE``), at the matmul rate
    of one micro-batch's tokens. The host dispatches ``LAUNCHES_PER_BLOCK_PASS`` ops per block,
    whatever the tokens, and measured not to hide behind the GPU's work (HF llama 340M on an
    H100: 1, 2 and 4 passes over the same 32K tokens took 0.255, 0.331 and 0.561 s). Checkpointed
    blocks run their forward again, on both sides. FSDP's gathers over the GPUs' links
    (``INTERCONNECT_GBPS``, not measured) and CPU offload's transfers over the host link are
    counted as if nothing overlapped them: an upper bound, which orders layouts by how much they
    move. The optimizer on the host (``host_step``) overlaps the next forward.
    """
    job = as_run(job, layout)
    passes = layout.micro_batches
    tokens = job.rows * job.tokens_per_row / passes
    forward = 2 * job.computed_params / job.tensor_parallel * tokens / (hardware.tflops(tokens) * 1e12) / MATMUL_SHARE
    launches = len(job.activations.blocks) * LAUNCHES_PER_BLOCK_PASS * hardware.launch_seconds / 3  # a forward's
    # the backward launches and computes about twice the forward: the inputs' gradients, and the weights' where
    # they train (LoRA's frozen base has none)
    one_pass = (2 + job.trainable_params / job.params) * (forward + launches)
    share = recompute_share(layout.ac, len(job.activations.blocks))
    shards = job.weight_shards // job.tensor_parallel
    gathers = 0.0
    if job.fsdp and shards > 1:
        per_pass = (2 if layout.reshard else 1) * job.compute_bytes * job.params / job.tensor_parallel
        gathers = passes * per_pass * (shards - 1) / shards / (INTERCONNECT_GBPS * 1e9)
    offload = 0.0
    if layout.offload:
        weights = job.trainable_params / job.weight_shards
        up = job.weight_bytes() / job.weight_shards  # fp32 weights (LoRA's base: in its own dtype) up, gradients down
        moved = passes * ((2 if layout.reshard else 1) * up + 4 * weights)
        link = hardware.host_link_gbps
        offload = moved / (link * 1e9) if link else math.inf
        if layout.host_optimizer:  # streamed: the host steps the offloaded weights in place beside the next forward
            offload += host_step(job, hardware, hidden_by=forward + launches, copies=False)
        else:  # FSDP2's own offload: torch's AdamW on the host between the steps
            offload += weights / hardware.host_adam_params_per_s
    elif layout.host_optimizer:
        offload = host_step(job, hardware, hidden_by=forward + launches)
    if layout.stream:
        offload = streamed(job, hardware, passes, hidden_by=one_pass + share * (forward + launches),
                           forward=forward + launches)
    if layout.park_inputs:  # each checkpointed input down and up a pass, on a side stream beside the blocks' compute
        moved = 2 * parked_input_bytes(job, layout) * job.rows / passes
        link = hardware.host_link_gbps
        offload += passes * max(0.0, (moved / (link * 1e9) if link else math.inf) - one_pass)
    return Price(compute=passes * one_pass, recompute=passes * share * (forward + launches), gathers=gathers,
                 offload=offload)


def streamed(job: Job, hardware: Hardware, passes: int, hidden_by: float, forward: float) -> float:
    """The seconds of --memory.stream_weights (flame.optim.streaming) that the passes do not hide.

    Each pass copies every weight up twice (its forward and its backward) as the host holds it (float32; LoRA's
    frozen base in its own dtype) and every gradient down in the compute dtype, on two streams beside the blocks'
    compute (``hidden_by``: a pass and its recompute); the two directions run at once. Over several ranks each
    moves its shard (the all-gathers and reduce-scatters are FSDP's, which ``price`` counts). The host's AdamW then runs
    beside the next forward, as --optimizer.on_host's does (``host_step``).
    """
    link = hardware.host_link_gbps * 1e9 if hardware.host_link_gbps else 0.0
    up, down = 2 * job.weight_bytes() / job.weight_shards, job.compute_bytes * job.trainable_params / job.weight_shards
    transfers = max(up, down) / link if link else math.inf
    return passes * max(0.0, transfers - hidden_by) + host_step(job, hardware, hidden_by=forward, copies=False)


def host_step(job: Job, hardware: Hardware, hidden_by: float, copies: bool = True) -> float:
    """The seconds of ``--optimizer.on_host``'s step the next forward (``hidden_by`` seconds) does not hide.

    Unit by unit (the embeddings, each block, the head), the gradients go down, the host steps
    and the weights go up (flame.optim.host): a pipeline as slow as its slowest
    stage, the host's AdamW, and filled by one unit's three stages, which the forward's start
    waits for (``copies``: False when the weights and gradients are on the host already, FSDP2's offload,
    whose transfers the caller counts). Calibrated on an H100 (fla transformer 1B, one row of 32K; docs/perf-log.md,
    2026-11-27): AdamW ran ``HOST_STEP_SLOWDOWN`` times slower beside the training loop than the
    probe measured it alone, and the forward hid ``FORWARD_HIDES`` of its time from it (the
    launching thread waits for each block's weights, so the GPU cannot run ahead).
    """
    weights = max(0, job.trainable_params - job.gpu_state_params) / job.weight_shards  # gpu_blocks' step on the GPU
    link = hardware.host_link_gbps * 1e9 if hardware.host_link_gbps else 0.0
    copy = 0.0 if not copies else 4 * weights / link if link else math.inf
    stages = (copy, HOST_STEP_SLOWDOWN * weights / hardware.host_adam_params_per_s, copy)
    filled = sum(stages) / (len(job.activations.blocks) + 2)
    return max(filled, max(stages) + filled - FORWARD_HIDES * hidden_by)


def recompute_share(ac: str, blocks: int) -> float:
    """The share of the forward an AC setting runs again: none 0, the first K or every N-th of ``blocks``
    blocks, all.

    Op-level selective AC counts as all: on these models it measured slower than full AC (HF llama
    and mamba2 at 340M: docs/perf-log.md, 2026-11-27).
    """
    shares = {"none": 0.0, "memory_budget": 0.0, "op": 1.0, "full": 1.0}
    if ac in shares:
        return shares[ac]
    count = first_blocks(ac)
    return (count if count is not None else blocks // int(ac)) / max(blocks, 1)
