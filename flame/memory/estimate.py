"""What one rank holds at its training step's peak, part by part, under a layout (``estimate``).

``estimate`` adds up, per rank, under the job's parallel layout: fp32 parameters, fp32 gradients,
the optimizer's fp32 state (its record's bytes a parameter, flame.optim.record: AdamW/Adam two
moments; Muon one momentum for the blocks' matrices, AdamW's two for the rest), FSDP's all-gather
buffers (one block's weights in the compute dtype, twice: the block computing and the one
prefetched; every block's once FSDP keeps them gathered after the forward), autocast's weight
copies (no FSDP, bf16; ``autocast_copies``), the activations (``flame.memory.activations``:
measured), the loss's logits, and an allocator margin.

A step peaks at one of these moments, and the estimate is the largest: the forward's end, where
every block's kept activations and the loss's chunk of logits are live and the gradients are
not yet allocated (unless a step accumulates them over micro-batches); the backward of a block,
where that block's activations (recomputed when checkpointed) and its backward's buffers are
live beside what the blocks before it kept, the logits are gone, and the gradients of this
block and the ones after it are allocated; and the backward's end, every gradient allocated.
Summing the moments' parts overestimated full AC, and counting every gradient at the backward's
first blocks overestimated a 1B (docs/perf-log.md, 2026-11-27 and 2026-11-28).
"""

from __future__ import annotations

from dataclasses import dataclass

from flame.memory.layout import Job, Layout, as_run, first_blocks

GIB = 1024**3
ONE_GPU, FSDP, FSDP_ALONE = "one GPU", "FSDP", "FSDP over one rank"
# the caching allocator's reserve over what the tensors take, by its segments (expandable or the default
# ones) and whether FSDP's gathers and reductions run on streams of their own, over ranks or over one process's
# rank alone (CPU offload, the optimizer on the host: copies, no collectives). Measured with expandable segments:
# one GPU 0.2-7.0% (7.0%: mamba2 340M at a 64K row, out of memory at step 2 under the 5% this was; gla 340M at the
# same row 4.7%); FSDP over 2 GPUs 17-19% (32% default segments; fla transformer 1B); FSDP over one rank 3-13%
# (transformer 7B and 1B on an H100). docs/perf-log.md 2026-11-27, -28, 2026-12-07
MARGINS = {(True, ONE_GPU): 0.08, (False, ONE_GPU): 0.10, (True, FSDP): 0.20, (False, FSDP): 0.35,
           (True, FSDP_ALONE): 0.15, (False, FSDP_ALONE): 0.35}
# A model whose forward launches fla's Triton kernels: on a new machine (or a new shape) each kernel times its
# candidate configurations at its first call, and the CUDA memory those load stays outside PyTorch's allocator,
# beyond the budget's reserve for the CUDA context. gla 340M's first steps on a fresh H100 held 2.8 GiB there, 1.8 GiB
# over that reserve, and ran out of memory at step 2 under a plan 0.8 GiB inside its budget (docs/perf-log.md,
# 2026-12-07)
KERNEL_TUNING_BYTES = 2 * 1024**3
FUSED_LOSS_CHUNK = 8192  # flame.models.loss's fused cross entropy computes this many tokens' logits at a time


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    where: str  # GPU or host
    note: str = ""


def estimate(job: Job, layout: Layout) -> list[Part]:
    """What one rank holds at its peak, part by part (the largest of the moments in the module's doc)."""
    job = as_run(job, layout)
    weights = job.trainable_params / job.weight_shards
    state = job.optimizer.state_of(job.trainable_params, min(job.matrix_params, job.trainable_params)) / job.weight_shards
    if layout.stream:
        parts, gradients, kept = streamed_parts(job, layout, state)
    else:
        parts, gradients, kept = _held_parts(job, layout, weights, state)

    rows = job.rows // layout.micro_batches
    scale = rows / job.tensor_parallel
    logits, loss_kept, loss_note = _loss(job, rows * job.tokens_per_row)
    accumulating = layout.micro_batches > 1 or job.accumulates
    on_gpu = gradients.bytes if kept == "GPU" else 0.0
    blocks = len(job.activations.blocks)
    if accumulating or not on_gpu:  # every gradient live all step long, or none on the GPU
        held = [on_gpu] * blocks
    else:  # allocated block by block in the backward, the last block's first
        per_block = 4 * job.block_params * job.trainable_params / job.params / job.weight_shards
        held = [min(on_gpu, per_block * (blocks - index)) for index in range(blocks)]
    end_copies, copies = autocast_copies(job, layout)
    end_activations = scale * forward_end_bytes(job, layout.ac, layout.park_inputs)
    at_end = end_activations + logits + end_copies + (on_gpu if accumulating else 0.0)
    during = [scale * activations + grads + held_copies
              for activations, grads, held_copies in zip(backward_bytes(job, layout.ac, layout.park_inputs), held, copies)]
    peak = max(range(blocks), key=during.__getitem__)
    if at_end >= max(during[peak], on_gpu):
        if not accumulating and on_gpu:
            gradients = Part("gradients", 0.0, kept, "fp32, allocated in the backward, after this peak")
        if end_copies:
            parts.append(Part("autocast weight copies", end_copies, "GPU", "one per weight, cached to the forward's end"))
        parts += [gradients, Part("activations", end_activations, "GPU", _recomputed(layout.ac) + "; the forward's end"),
                  Part("loss", logits + loss_kept, "GPU", loss_note)]
    elif during[peak] >= on_gpu:
        if copies[peak]:
            parts.append(Part("autocast weight copies", copies[peak], "GPU",
                              "this block's and those of the blocks before it kept whole (a checkpointed block "
                              "casts again when recomputed)"))
        if held[peak] < on_gpu:
            count = blocks - peak
            whose = "the last block's" if count == 1 else f"the last {count} blocks'"
            gradients = Part("gradients", held[peak], kept,
                             f"fp32, {whose} so far (all: {on_gpu / GIB:.3f} GiB, by the backward's end)")
        parts += [gradients, Part("activations", during[peak] - held[peak] - copies[peak], "GPU",
                                  f"{_recomputed(layout.ac)}; the backward's peak (block {peak + 1} of {blocks})"),
                  Part("loss", loss_kept, "GPU", "the head's gradients, kept for the backward (the logits are freed)")]
    else:  # the backward's end: every gradient, the activations freed
        parts.append(Part("gradients", on_gpu, kept, "fp32, all of them: the backward's end, the activations freed"))
    if layout.park_inputs:
        parts.append(Part("parked block inputs", scale * parked_input_bytes(job, layout), "host (pinned)",
                          "the checkpointed blocks' inputs, from the forward to the backward"))
    streams = ONE_GPU if not (job.fsdp or layout.offload) or layout.stream else FSDP_ALONE if job.alone else FSDP
    margin = MARGINS[(job.expandable_segments, streams)]
    allocator = "expandable segments" if job.expandable_segments else "the allocator's default segments"
    allocator += {ONE_GPU: "", FSDP: ", FSDP's streams", FSDP_ALONE: ", FSDP's streams over one rank"}[streams]
    parts.append(Part("allocator margin", margin * gpu_bytes(parts), "GPU", f"{margin:.0%} fragmentation ({allocator})"))
    if job.activations.triton_kernels:
        parts.append(Part("kernels' tuning", KERNEL_TUNING_BYTES, "GPU",
                          "outside PyTorch's allocator: fla's kernels load every configuration they time"))
    return parts


def _held_parts(job: Job, layout: Layout, weights: float, state: float) -> tuple[list[Part], Part, str]:
    """The parameters, gradients and optimizer state where the job keeps them (the GPU, FSDP's CPU offload, the
    optimizer on the host), and FSDP's buffers; the gradients' part apart (the peak's moment places it)."""
    kept = "host (CPU offload)" if layout.offload else "GPU"
    state_note = f"{job.optimizer.name}: fp32, {job.optimizer.state}"
    held = f"LoRA: the frozen base in {job.frozen_bytes}-byte elements, the adapters in fp32" if job.frozen_params else "fp32"
    # offloaded, FSDP pins each weight's shard and each gradient: PyTorch's pinned allocator rounds them up
    pinning = job.offload_pinning if layout.offload else 1.0
    rounded = f", pinned (+{pinning - 1:.0%}: each rounded up to a power of two)" if pinning > 1.0005 else ""
    parts = [Part("parameters", pinning * job.weight_bytes() / job.weight_shards, kept,
                  f"{held}, 1/{job.weight_shards} per rank{rounded}")]
    if job.ema:
        parts.append(Part("weights' average", 4 * weights, kept, "fp32, --training.ema_decay"))
    gradients = Part("gradients", pinning * 4 * weights, kept, f"fp32{rounded}")
    if layout.host_optimizer:
        # --optimizer.gpu_blocks: the state of the embeddings and the first blocks stays on the GPU
        on_gpu = job.optimizer.state_bytes * min(job.gpu_state_params, job.trainable_params) / job.weight_shards
        parts.append(Part("optimizer state", state - on_gpu, "host (stepped there)", state_note))
        if on_gpu:
            parts.append(Part("optimizer state", on_gpu, "GPU", "of the embeddings and the first blocks "
                                                                  "(--optimizer.gpu_blocks)"))
        if not layout.offload:  # streamed (with offload), the host steps the offloaded weights in place
            copied = 8 * max(0.0, weights - job.gpu_state_params / job.weight_shards)
            parts.append(Part("host step buffers", job.host_copy_pinning * copied, "host (pinned)",
                              "fp32 copies of the weights and gradients, in pinned chunks"))
    else:
        parts.append(Part("optimizer state", state, kept, state_note))
    if job.fsdp or layout.offload:
        gathered = job.params if not layout.reshard else 2 * job.block_params
        why = "every block stays gathered after the forward" if not layout.reshard else "one block and its prefetch"
        parts.append(Part("FSDP all-gather buffers", gathered * job.compute_bytes / job.tensor_parallel, "GPU", why))
    return parts, gradients, kept


def streamed_parts(job: Job, layout: Layout, state: float) -> tuple[list[Part], Part, str]:
    """--memory.stream_weights (flame.optim.streaming): the weights, gradients and optimizer state on the host (a
    rank's shard of them); on the GPU two blocks' weights and gradients in flight, and the rest of the model's
    (embeddings, norm, head)."""
    itemsize, pinning, shards = job.compute_bytes, job.stream_pinning, job.weight_shards
    trainable = job.trainable_params / shards
    chunks = f", in pinned chunks (+{pinning - 1:.0%})" if pinning > 1.0005 else ""
    frozen = ", LoRA's frozen base in its own dtype" if job.frozen_params else ""
    parts = [Part("parameters", pinning * job.weight_bytes() / shards, "host (pinned)",
                  f"fp32{frozen}: copied up, stepped, saved by checkpoints{chunks}"),
             Part("optimizer state", state, "host (stepped there)",
                  f"{job.optimizer.name}: fp32, {job.optimizer.state}"),
             Part("streamed gradients", pinning * itemsize * trainable, "host (pinned)",
                  f"copied down in the compute dtype{chunks}")]
    if layout.micro_batches > 1 or job.accumulates:
        parts.append(Part("gradient sums", 4 * trainable, "host", "fp32, the micro-batches' gradients added up"))
    in_flight = itemsize * (2 * job.block_params + job.resident_params)
    parts += [Part("streamed weights", in_flight + 4 * 2 * job.block_params, "GPU",
                   "two blocks' (the one running, the next one copied up in fp32 and cast) and the embeddings', "
                   "norm's and head's, in the compute dtype"),
              Part("gradients in flight", in_flight, "GPU", "two blocks' (one made, one copied down) and the "
                                                             "embeddings', norm's and head's, in the compute dtype")]
    if shards > 1:  # flame.optim.stream_shards: a block's all-gather (its output and this rank's shard) beside one
        # block's reduce-scatter (its float32 input and output: --training.mixed_precision_reduce's default)
        parts.append(Part("all-gather and reduce-scatter buffers", (itemsize + 4) * job.block_params * (1 + 1 / shards),
                          "GPU", f"one block's each, over {shards} ranks"))
        # each process initializes the whole model on its host, then keeps its shards (parallelize.materialize_on_host):
        # the host's peak is then, if the whole model outweighs what the step keeps there
        held = host_bytes(parts)
        if (whole := job.weight_bytes()) > held:
            parts.append(Part("the whole model, at initialization", whole - held, "host",
                              f"each process initializes all {whole / GIB:.1f} GiB, then keeps its shards: the "
                              "host's peak"))
    return parts, Part("gradients", 0.0, "host (streamed)", "copied down block by block"), "host (streamed)"


def _loss(job: Job, tokens: int) -> tuple[float, float, str]:
    """(bytes only the forward's end holds, bytes kept into the backward, the note) of the loss over ``tokens``."""
    if job.fused_loss:
        # flame.models.loss: each chunk's fp32 logits and their gradient, then freed; the hidden states'
        # gradient (in their dtype) and the head's fp32 weight gradient kept for the backward
        logits = 2 * 4 * min(tokens, FUSED_LOSS_CHUNK) * job.vocab_size
        kept = tokens * job.hidden_size * job.hidden_bytes + 4 * job.vocab_size * job.hidden_size / job.tensor_parallel
        return logits, kept, f"fused, chunked: {FUSED_LOSS_CHUNK} tokens' fp32 logits and gradient, the head's gradients"
    # the logits are kept for the backward, with their fp32 copy and its gradient
    return 0.0, tokens * job.vocab_size * (job.compute_bytes + 8), "logits, their fp32 copy and its gradient"


def _recomputed(ac: str) -> str:
    if (count := first_blocks(ac)) is not None:
        return f"the first {count} blocks' inputs kept and the blocks recomputed, the rest kept whole"
    return {"none": "kept", "full": "block inputs kept, blocks recomputed", "op": "matmul outputs kept, rest recomputed",
            "memory_budget": "counted as kept (the compiler decides)"}.get(ac, f"every {ac}th block recomputed")


def activation_moments(job: Job, ac: str) -> tuple[float, float]:
    """Bytes one row's activations take at the forward's end, and at their peak in the backward, under ``ac``."""
    return forward_end_bytes(job, ac), max(backward_bytes(job, ac))


def forward_end_bytes(job: Job, ac: str, parked: bool = False) -> float:
    """Bytes one row's activations take at the forward's end, under ``ac``: what every block kept (``parked``: the
    checkpointed blocks' inputs on the host)."""
    return job.activations.rest.at(job.tokens_per_row, job.dense_attention) + sum(_kept(job, ac, parked)[0])


def autocast_copies(job: Job, layout: Layout) -> tuple[float, list[float]]:
    """(bytes of autocast's weight copies at the forward's end, during each block's backward), under ``layout``
    (none under FSDP or CPU offload: FSDP casts the weights it gathers).

    Autocast caches one cast copy of each weight until its region ends, with the loss: at the forward's end
    every copy is live. The backward runs outside that region, and a copy outlives it only where an op saved
    it for the backward: the blocks kept whole hold theirs until their own backward, a checkpointed block's
    copies are cast again when it is recomputed, and freed after it. Counting every copy at a checkpointed
    backward overestimated full AC of the 1B models by 8-12% (docs/perf-log.md, 2026-11-28).
    """
    blocks = len(job.activations.blocks)
    if not job.autocast_copies or job.fsdp or layout.offload:
        return 0.0, [0.0] * blocks
    block_copy = job.block_params * job.compute_bytes
    whole_before, during = 0, []
    for index in range(blocks):
        during.append((whole_before + 1) * block_copy)
        whole_before += not _checkpointed(layout.ac, index)
    return job.params * job.compute_bytes, during


def backward_bytes(job: Job, ac: str, parked: bool = False) -> list[float]:
    """Bytes one row's activations take during each block's backward, under ``ac`` (block order).

    Each block keeps something through the forward (everything; its input under full AC; its
    input and the matmul outputs under op-level AC); its backward then needs all of its
    activations (recomputed when checkpointed) and its backward's own buffers, while the blocks
    before it still hold what they kept, and the blocks after it have freed theirs. With ``parked`` inputs
    (flame.distributed.activation_offload) a checkpointed block keeps nothing on the GPU, and a backward holds
    beside its own (recomputed) activations the input of the block before it, back from the host ahead of time.
    """
    kept, blocks = _kept(job, ac, parked)
    rest = job.activations.rest.at(job.tokens_per_row, job.dense_attention)
    workspace = job.activations.backward.at(job.tokens_per_row, job.dense_attention)
    ahead = job.activations.block_input * job.tokens_per_row
    before, during = 0.0, []
    for index, (kept_here, whole) in enumerate(zip(kept, blocks)):
        fetched = ahead if index > 0 and _parked(ac, index - 1, len(blocks), parked) else 0.0
        during.append(rest + before + whole + workspace + fetched)
        before += kept_here
    return during


def _checkpointed(ac: str, index: int) -> bool:
    """Whether ``ac`` recomputes block ``index`` in the backward (any of full, op-level, first-K, every-N)."""
    if ac in ("none", "memory_budget"):
        return False
    if ac in ("full", "op"):
        return True
    if (count := first_blocks(ac)) is not None:
        return index < count
    return (index + 1) % int(ac) == 0


def _parked(ac: str, index: int, blocks: int, parked: bool) -> bool:
    """Whether block ``index``'s input waits on the host (checkpointed, and not the model's last block)."""
    return parked and index < blocks - 1 and _checkpointed(ac, index)


def parked_input_bytes(job: Job, layout: Layout) -> float:
    """Bytes of one row's checkpointed block inputs on the host under ``layout`` (0 without parking)."""
    blocks = len(job.activations.blocks)
    count = sum(_parked(layout.ac, index, blocks, layout.park_inputs) for index in range(blocks))
    return count * job.activations.block_input * job.tokens_per_row


def _kept(job: Job, ac: str, parked: bool = False) -> tuple[list[float], list[float]]:
    """(what each block keeps through the forward under ``ac``, everything each block saves), for one row."""
    profile, tokens = job.activations, job.tokens_per_row
    square = job.dense_attention
    blocks = [block.at(tokens, square) for block in profile.blocks]
    inputs = profile.block_input * tokens
    if ac in ("none", "memory_budget"):
        kept = blocks
    elif ac == "full":
        kept = [inputs] * len(blocks)
    elif ac == "op":
        kept = [inputs + selective.at(tokens, square) for selective in profile.selective]
    else:  # the first K blocks (the last ones, whose backward comes first, kept whole), or torchtitan's every
        # N-th block (the N-th, 2N-th, ...) checkpointed
        kept = [inputs if _checkpointed(ac, index) else block for index, block in enumerate(blocks)]
    if parked:
        kept = [0.0 if _parked(ac, index, len(blocks), parked) else here for index, here in enumerate(kept)]
    return kept, blocks


def activation_bytes(job: Job, ac: str) -> float:
    """The larger of ``activation_moments``: what one row's activations peak at under ``ac``."""
    return max(activation_moments(job, ac))


def gpu_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where == "GPU")


def host_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where != "GPU")
