"""The memory plan: what each part of a training step needs on one rank, and the fastest layout that fits.

``estimate`` adds up, per rank, under the job's parallel layout: fp32 parameters, fp32 gradients,
the optimizer's fp32 state (AdamW/Adam: two moments; Muon: one momentum for the blocks' matrices,
AdamW's two for the rest), FSDP's all-gather buffers (one block's weights in the compute dtype,
twice: the block computing and the one prefetched; every block's once FSDP keeps them gathered
after the forward), autocast's weight copies (no FSDP, bf16; ``autocast_copies``), the activations
(``flame.memory.activations``: measured), the loss's logits, and an allocator margin.

A step peaks at one of these moments, and the estimate is the largest: the forward's end, where
every block's kept activations and the loss's chunk of logits are live and the gradients are
not yet allocated (unless a step accumulates them over micro-batches); the backward of a block,
where that block's activations (recomputed when checkpointed) and its backward's buffers are
live beside what the blocks before it kept, the logits are gone, and the gradients of this
block and the ones after it are allocated; and the backward's end, every gradient allocated.
Summing the moments' parts overestimated full AC by a sixth (gla 340M on an H100), and counting
every gradient at the backward's first blocks overestimated the 1B by 4 GiB (docs/perf-log.md,
2026-11-27 and 2026-11-28).

``choose`` keeps the job as configured when it fits (under FSDP keeping the weights gathered after
the forward where that fits too: a second all-gather a block saved for memory alone). Otherwise it
weighs every layout the job may take (full activation checkpointing of the first K blocks, for any
K, or of all; FSDP resharding after the forward; CPU offload of parameters, gradients and optimizer
state; the optimizer state alone on the host, stepped there while the next forward runs; splitting
each batch into micro-batches; and their combinations), prices each from this machine's measured
rates (``flame.memory.price``, from ``flame.memory.hardware``: matmul TFLOP/s, the host link, a host
AdamW step, an op launch) and takes the cheapest that fits the GPU budget. A setting the job file or
the command line gives is kept; no layout changes it. The job and the settings a plan may change are
``flame.memory.layout``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flame.memory.layout import FIRST, Job, Layout, as_run, first_blocks
from flame.memory.price import Price, price, recompute_share

if TYPE_CHECKING:
    from flame.memory.hardware import Hardware

GIB = 1024**3
ONE_GPU, FSDP, FSDP_ALONE = "one GPU", "FSDP", "FSDP over one rank"
# the caching allocator's reserve over what the tensors take, by its segments (expandable or the default
# ones) and whether FSDP's gathers and reductions run on streams of their own, over ranks or over one process's
# rank alone (CPU offload, the optimizer on the host: copies, no collectives). Measured with expandable segments:
# one GPU 0.2-6.5%; FSDP over 2 GPUs 17-19% (32% default segments; fla transformer 1B); FSDP over one rank 3-13%
# (transformer 7B and 1B on an H100). docs/perf-log.md 2026-11-27, -28
MARGINS = {(True, ONE_GPU): 0.05, (False, ONE_GPU): 0.10, (True, FSDP): 0.20, (False, FSDP): 0.35,
           (True, FSDP_ALONE): 0.15, (False, FSDP_ALONE): 0.35}
FUSED_LOSS_CHUNK = 8192  # flame.components.loss's fused cross entropy computes this many tokens' logits at a time
ALTERNATIVES_SHOWN = 3  # the plan's table names this many of the next cheapest layouts that fit
PRICE_TOLERANCE = 0.05  # layouts priced this close count as equal: the one that changes the job least wins


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    where: str  # GPU or host
    note: str = ""


def estimate(job: Job, layout: Layout) -> list[Part]:
    """What one rank holds at its peak, part by part (the largest of the moments in the module's doc)."""
    job = as_run(job, layout)
    weights = job.params / job.weight_shards
    state = 8 * weights if job.optimizer != "Muon" else 4 * job.matrix_params / job.weight_shards + 8 * (
        job.params - job.matrix_params) / job.weight_shards
    kept = "host (CPU offload)" if layout.offload else "GPU"
    moments = "one momentum for matrices, AdamW's two for the rest" if job.optimizer == "Muon" else "two moments"
    parts = [Part("parameters", 4 * weights, kept, f"fp32, 1/{job.weight_shards} per rank")]
    gradients = Part("gradients", 4 * weights, kept, "fp32")
    if layout.host_optimizer:
        # --optimizer.gpu_blocks: the state of the embeddings and the first blocks stays on the GPU
        on_gpu = 8 * job.gpu_state_params / job.weight_shards
        parts.append(Part("optimizer state", state - on_gpu, "host (stepped there)", f"{job.optimizer}: fp32, {moments}"))
        if on_gpu:
            parts.append(Part("optimizer state", on_gpu, "GPU", "of the embeddings and the first blocks "
                                                                  "(--optimizer.gpu_blocks)"))
        parts.append(Part("host step buffers", 8 * (weights - job.gpu_state_params / job.weight_shards),
                          "host (pinned)", "fp32 copies of the weights and gradients"))
    else:
        parts.append(Part("optimizer state", state, kept, f"{job.optimizer}: fp32, {moments}"))
    if job.fsdp or layout.offload:
        gathered = job.params if not layout.reshard else 2 * job.block_params
        why = "every block stays gathered after the forward" if not layout.reshard else "one block and its prefetch"
        parts.append(Part("FSDP all-gather buffers", gathered * job.compute_bytes / job.tensor_parallel, "GPU", why))

    rows = job.rows // layout.micro_batches
    scale = rows / job.tensor_parallel
    logits, loss_kept, loss_note = _loss(job, rows * job.tokens_per_row)
    accumulating = layout.micro_batches > 1 or job.accumulates
    on_gpu = gradients.bytes if kept == "GPU" else 0.0
    blocks = len(job.activations.blocks)
    if accumulating or not on_gpu:  # every gradient live all step long, or none on the GPU
        held = [on_gpu] * blocks
    else:  # allocated block by block in the backward, the last block's first
        per_block = 4 * job.block_params / job.weight_shards
        held = [min(on_gpu, per_block * (blocks - index)) for index in range(blocks)]
    end_copies, copies = autocast_copies(job, layout)
    end_activations = scale * forward_end_bytes(job, layout.ac)
    at_end = end_activations + logits + end_copies + (on_gpu if accumulating else 0.0)
    during = [scale * activations + grads + held_copies
              for activations, grads, held_copies in zip(backward_bytes(job, layout.ac), held, copies)]
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
    streams = ONE_GPU if not (job.fsdp or layout.offload) else FSDP_ALONE if job.alone else FSDP
    margin = MARGINS[(job.expandable_segments, streams)]
    allocator = "expandable segments" if job.expandable_segments else "the allocator's default segments"
    allocator += {ONE_GPU: "", FSDP: ", FSDP's streams", FSDP_ALONE: ", FSDP's streams over one rank"}[streams]
    parts.append(Part("allocator margin", margin * gpu_bytes(parts), "GPU", f"{margin:.0%} fragmentation ({allocator})"))
    return parts


def _loss(job: Job, tokens: int) -> tuple[float, float, str]:
    """(bytes only the forward's end holds, bytes kept into the backward, the note) of the loss over ``tokens``."""
    if job.fused_loss:
        # flame.components.loss: each chunk's fp32 logits and their gradient, then freed; the hidden states'
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


def forward_end_bytes(job: Job, ac: str) -> float:
    """Bytes one row's activations take at the forward's end, under ``ac``: what every block kept."""
    return job.activations.rest.at(job.tokens_per_row, job.dense_attention) + sum(_kept(job, ac)[0])


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


def backward_bytes(job: Job, ac: str) -> list[float]:
    """Bytes one row's activations take during each block's backward, under ``ac`` (block order).

    Each block keeps something through the forward (everything; its input under full AC; its
    input and the matmul outputs under op-level AC); its backward then needs all of its
    activations (recomputed when checkpointed) and its backward's own buffers, while the blocks
    before it still hold what they kept, and the blocks after it have freed theirs.
    """
    kept, blocks = _kept(job, ac)
    rest = job.activations.rest.at(job.tokens_per_row, job.dense_attention)
    workspace = job.activations.backward.at(job.tokens_per_row, job.dense_attention)
    before, during = 0.0, []
    for kept_here, whole in zip(kept, blocks):
        during.append(rest + before + whole + workspace)
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


def _kept(job: Job, ac: str) -> tuple[list[float], list[float]]:
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
    return kept, blocks


def activation_bytes(job: Job, ac: str) -> float:
    """The larger of ``activation_moments``: what one row's activations peak at under ``ac``."""
    return max(activation_moments(job, ac))


def gpu_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where == "GPU")


def host_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where != "GPU")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    gpu_bytes: float
    price: Price | None  # None: not priced (the layout as configured fits, or no choice was asked for)


@dataclass(frozen=True)
class Plan:
    """The layout chosen, the layouts weighed (cheapest first), and the parts of the chosen one."""

    layout: Layout
    start: Layout
    weighed: list[Candidate]
    parts: list[Part]
    gpu_budget: float | None
    host_budget: float | None
    fits: bool
    why: str
    hardware: Hardware | None = None

    @property
    def gpu_bytes(self) -> float:
        return gpu_bytes(self.parts)


def candidates(job: Job, start: Layout, fixed: set[str], host_budget: float | None) -> list[Layout]:
    """Every layout the plan may take from ``start``: each setting the job does not give, in each allowed value.

    Activation checkpointing only recomputes more than ``start`` does (``ac_options``). Offload
    needs a GPU job that FSDP can wrap, an optimizer that steps on the host (not Muon), and room in
    the host budget; so does the optimizer on the host, which a pipeline cannot take and which
    FSDP2's offload already is. Micro-batches divide the rows evenly.
    """
    acs = [start.ac] if "ac" in fixed else [start.ac, *ac_options(job, start.ac)]
    reshards = [start.reshard] + ([True] if job.fsdp and "reshard" not in fixed and not start.reshard else [])

    def fits_host(**change) -> bool:
        return host_budget is None or host_bytes(estimate(job, dataclasses.replace(start, **change))) <= host_budget

    offloads = [start.offload]
    if job.can_offload and "offload" not in fixed and not start.offload and job.optimizer != "Muon" and fits_host(
            offload=True, host_optimizer=False):
        offloads.append(True)
    on_host = [start.host_optimizer]
    if job.can_step_on_host and "host_optimizer" not in fixed and not start.host_optimizer and fits_host(
            host_optimizer=True):
        on_host.append(True)
    counts = [start.micro_batches] + ([] if "micro_batches" in fixed else [
        count for count in range(start.micro_batches + 1, job.rows + 1) if job.rows % count == 0])
    return [Layout(ac=ac, reshard=reshard, offload=offload, micro_batches=count, host_optimizer=host)
            for ac in acs for reshard in reshards for offload in offloads for count in counts for host in on_host
            if not (offload and host)]


def ac_options(job: Job, current: str) -> list[str]:
    """The activation checkpointing settings that recompute more than ``current``, least first.

    The options are full AC of the first K blocks, for each K, and of all: any share of the blocks
    recomputed, where torchtitan's every-N-th-block AC offers a half, a third, a quarter.
    Checkpointing the first blocks rather than every N-th keeps the last ones whole, and their
    backward runs first: the backward's peak is then the forward's, where a recomputed last block
    adds its activations on top (``activation_bytes``).

    Never op-level selective AC: torchtitan's policy keeps only PyTorch ops' outputs, so it runs
    again every Triton kernel of fla's blocks and most of an HF block, and measured slower than
    full AC while keeping more (HF llama 340M on an H100: 78.8k tok/s at 23.4 GiB against 99.2k
    at 12.6 GiB; docs/perf-log.md 2026-11-27). A job may still give it.
    """
    blocks = len(job.activations.blocks)
    firsts = [f"{FIRST}{count}" for count in range(1, blocks)]
    options = ([str(every) for every in (4, 3, 2) if every <= blocks] if job.pipelined else firsts) + ["full"]
    here = recompute_share(current, blocks)
    return [ac for ac in options if recompute_share(ac, blocks) > here]


def _changes(start: Layout, layout: Layout, blocks: int) -> tuple:
    """How far a layout strays from ``start``, for choosing between layouts priced alike: offload, then the
    optimizer on the host, then micro-batches, then resharding, then recomputation, the changes a user
    notices most first."""
    return (layout.offload != start.offload, layout.host_optimizer != start.host_optimizer, layout.micro_batches,
            layout.reshard != start.reshard, recompute_share(layout.ac, blocks))


def choose(job: Job, start: Layout, fixed: set[str], gpu_budget: float | None, host_budget: float | None,
           rates: Callable[[], Hardware]) -> Plan:
    """The cheapest layout that fits ``gpu_budget`` (no budget, or ``start`` fits: ``start``, unchanged, but for
    FSDP keeping the weights gathered after the forward where that fits too).

    ``rates`` gives this machine's rates; it is called only when there is a choice to price.

    Layouts priced within ``PRICE_TOLERANCE`` of the cheapest count as equal, and the one that
    changes the job least wins among them, so noise in the measured rates does not flip the plan.
    """
    parts = estimate(job, start)
    if gpu_budget is None:
        return Plan(start, start, [Candidate(start, gpu_bytes(parts), None)], parts, gpu_budget, host_budget, True,
                    "no device memory to fit: nothing changed")
    if gpu_bytes(parts) <= gpu_budget:
        # the one change that costs only memory: FSDP keeps each block's weights gathered for its backward
        # instead of gathering them again (llama 340M on 4 GPUs: 85% -> 92% of one GPU's tokens/s per GPU)
        if job.fsdp and start.reshard and "reshard" not in fixed:
            gathered = dataclasses.replace(start, reshard=False)
            kept = estimate(job, gathered)
            if gpu_bytes(kept) <= gpu_budget:
                return Plan(gathered, start, [Candidate(gathered, gpu_bytes(kept), None)], kept, gpu_budget,
                            host_budget, True, "fits with every block's weights kept gathered after the forward: one "
                                               "all-gather a block a step, not two")
        return Plan(start, start, [Candidate(start, gpu_bytes(parts), None)], parts, gpu_budget, host_budget, True,
                    "fits as configured")
    hardware = rates()
    blocks = len(job.activations.blocks)
    weighed = sorted((Candidate(layout, gpu_bytes(estimate(job, layout)), price(job, layout, hardware))
                      for layout in candidates(job, start, fixed, host_budget)),
                     key=lambda candidate: (candidate.price.seconds, _changes(start, candidate.layout, blocks)))
    fitting = [candidate for candidate in weighed if candidate.gpu_bytes <= gpu_budget]
    if not fitting:
        smallest = min(weighed, key=lambda candidate: candidate.gpu_bytes)
        return Plan(smallest.layout, start, weighed, estimate(job, smallest.layout), gpu_budget, host_budget, False,
                    f"needs {smallest.gpu_bytes / GIB:.2f} GiB with {smallest.layout.describe()}", hardware)
    cheapest = fitting[0].price.seconds
    alike = [candidate for candidate in fitting if candidate.price.seconds <= cheapest * (1 + PRICE_TOLERANCE)]
    chosen = min(alike, key=lambda candidate: _changes(start, candidate.layout, blocks))
    unplanned = price(job, start, hardware).seconds
    among = f"the cheapest of {len(fitting)} layouts that fit" if len(fitting) > 1 else "the only layout that fits"
    why = (f"{chosen.gpu_bytes / GIB:.2f} GiB fits the {gpu_budget / GIB:.2f} GiB budget; priced "
           f"{chosen.price.seconds:.3g} s a step against {unplanned:.3g} s as configured "
           f"({gpu_bytes(parts) / GIB:.2f} GiB), {among}")
    return Plan(chosen.layout, start, weighed, estimate(job, chosen.layout), gpu_budget, host_budget, True, why,
                hardware)


def table(plan: Plan, method: str) -> str:
    """The plan as the log shows it: one line per part, then the layout chosen and why."""
    lines = [f"{'component':<26}{'GiB':>9}  {'where':<20}note"]
    for part in plan.parts:
        lines.append(f"{part.name:<26}{part.bytes / GIB:>9.3f}  {part.where:<20}{part.note}")
    budget = f" of a {plan.gpu_budget / GIB:.2f} GiB budget" if plan.gpu_budget is not None else ""
    lines.append(f"{'total on the GPU':<26}{plan.gpu_bytes / GIB:>9.3f}{budget}")
    if host := host_bytes(plan.parts):
        lines.append(f"{'total on the host':<26}{host / GIB:>9.3f}")
    lines.append(f"activations: {method}")
    lines.append(f"plan: {plan.layout.describe()} ({plan.why})")
    if plan.hardware is not None:
        chosen = next(candidate.price for candidate in plan.weighed if candidate.layout == plan.layout)
        lines.append(f"its step priced: passes {chosen.compute:.3g} s (GPU and host), recomputed {chosen.recompute:.3g} s, "
                     f"FSDP gathers {chosen.gathers:.3g} s, host transfers and step {chosen.offload:.3g} s; "
                     f"rates measured on {plan.hardware.describe()}")
        others = [candidate for candidate in plan.weighed if candidate.layout != plan.layout
                  and plan.gpu_budget is not None and candidate.gpu_bytes <= plan.gpu_budget][:ALTERNATIVES_SHOWN]
        if others:
            lines.append("next cheapest that fit: " + "; ".join(
                f"{other.layout.describe()} {other.price.seconds:.3g} s, {other.gpu_bytes / GIB:.2f} GiB" for other in others))
    return "\n".join(lines)
