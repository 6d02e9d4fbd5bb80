"""The memory plan: what each part of a training step needs on one rank, and the fastest layout that fits.

``estimate`` adds up, per rank, under the job's parallel layout: fp32 parameters, fp32 gradients,
the optimizer's fp32 state (AdamW/Adam: two moments; Muon: one momentum for the blocks' matrices,
AdamW's two for the rest), FSDP's all-gather buffers (one block's weights in the compute dtype,
twice: the block computing and the one prefetched; every block's once FSDP keeps them gathered
after the forward), autocast's weight copies (no FSDP, bf16), the activations
(``flame.memory.activations``: measured), the loss's logits, and an allocator margin. All of
them count as live at once: with gradient accumulation they are, and without it the sum is an
upper bound.

``choose`` walks the layouts in order of their cost in speed (nothing; op-level selective AC;
full AC; FSDP resharding after the forward; CPU offload of parameters, gradients and optimizer
state; splitting each batch into micro-batches) and takes the first that fits the GPU budget.
A setting the job file or the command line gives is kept, and the steps that would change it
are skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flame.memory.activations import ActivationProfile

GIB = 1024**3
MARGIN = 0.10  # the caching allocator's fragmentation: 10% over what the tensors themselves take
FUSED_LOSS_CHUNK = 8192  # flame.components.loss's fused cross entropy computes this many tokens' logits at a time


def describe_ac(ac: str) -> str:
    """A ``Layout.ac`` setting in words."""
    return {"none": "no AC", "full": "full AC", "op": "op-level selective AC",
            "memory_budget": "compiler-chosen AC (memory_budget)"}.get(ac, f"selective AC every {ac} blocks")


@dataclass(frozen=True)
class Layout:
    """The settings the plan may change."""

    ac: str = "none"  # none, full, op (op-level selective), every-N (selective, an int N), memory_budget
    reshard: bool = True  # FSDP frees each block's gathered weights after its forward
    offload: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host
    micro_batches: int = 1  # the rows of training.batch_size split over this many accumulation steps

    def describe(self) -> str:
        parts = [describe_ac(self.ac)]
        if self.offload:
            parts.append("CPU offload")
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
    compute_bytes: int  # bytes per element of the compute dtype
    optimizer: str
    rows: int  # training.batch_size (per rank, before any split into micro-batches)
    tokens_per_row: int  # seq_len over the context-parallel degree
    weight_shards: int  # FSDP shards x tensor- and pipeline-parallel degree
    fsdp: bool
    can_offload: bool  # a GPU job under FSDP, or of one process (FSDP wraps it alone to offload it)
    autocast_copies: bool  # no FSDP and a bf16/fp16 compute dtype: autocast keeps a cast copy of each weight
    fused_loss: bool
    dense_attention: bool  # sdpa keeps the T x T weights; flash-style kernels do not
    tensor_parallel: int
    activations: ActivationProfile = field(repr=False)


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    where: str  # GPU or host
    note: str = ""


def estimate(job: Job, layout: Layout) -> list[Part]:
    """What one rank holds at its peak, part by part."""
    weights = job.params / job.weight_shards
    state = 8 * weights if job.optimizer != "Muon" else 4 * job.matrix_params / job.weight_shards + 8 * (
        job.params - job.matrix_params) / job.weight_shards
    kept = "host (CPU offload)" if layout.offload else "GPU"
    moments = "one momentum for matrices, AdamW's two for the rest" if job.optimizer == "Muon" else "two moments"
    parts = [
        Part("parameters", 4 * weights, kept, f"fp32, 1/{job.weight_shards} per rank"),
        Part("gradients", 4 * weights, kept, "fp32"),
        Part("optimizer state", state, kept, f"{job.optimizer}: fp32, {moments}"),
    ]
    if job.fsdp or layout.offload:
        gathered = job.params if not layout.reshard else 2 * job.block_params
        why = "every block stays gathered after the forward" if not layout.reshard else "one block and its prefetch"
        parts.append(Part("FSDP all-gather buffers", gathered * job.compute_bytes / job.tensor_parallel, "GPU", why))
    elif job.autocast_copies:
        parts.append(Part("autocast weight copies", job.params * job.compute_bytes, "GPU", "one per weight"))
    rows = job.rows // layout.micro_batches
    parts.append(Part("activations", rows * activation_bytes(job, layout.ac) / job.tensor_parallel, "GPU",
                      _recomputed(layout.ac)))
    tokens = rows * job.tokens_per_row
    if job.fused_loss:
        logits = 2 * 4 * min(tokens, FUSED_LOSS_CHUNK) * job.vocab_size
        parts.append(Part("loss (fused, chunked)", logits, "GPU", f"{FUSED_LOSS_CHUNK} tokens' fp32 logits + gradient"))
    else:
        logits = tokens * job.vocab_size * (job.compute_bytes + 8)
        parts.append(Part("logits and loss", logits, "GPU", "logits, their fp32 copy and its gradient"))
    on_gpu = sum(part.bytes for part in parts if part.where == "GPU")
    parts.append(Part("allocator margin", MARGIN * on_gpu, "GPU", f"{MARGIN:.0%} fragmentation"))
    return parts


def _recomputed(ac: str) -> str:
    return {"none": "kept", "full": "block inputs kept, blocks recomputed", "op": "matmul outputs kept, rest recomputed",
            "memory_budget": "counted as kept (the compiler decides)"}.get(ac, f"every {ac}th block recomputed")


def activation_bytes(job: Job, ac: str) -> float:
    """Bytes one row's activations peak at under activation checkpointing ``ac``.

    Each block keeps something through the forward (everything; its input under full AC; its
    input and the matmul outputs under op-level AC); its backward then needs all of its
    activations (recomputed when checkpointed) while the blocks before it still hold what they
    kept, and the blocks after it have freed theirs. The peak is the largest of those moments.
    """
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
    else:  # selective every N blocks: torchtitan checkpoints the N-th, 2N-th, ... block and keeps the others whole
        every = int(ac)
        kept = [inputs if (index + 1) % every == 0 else block for index, block in enumerate(blocks)]
    before, peak = 0.0, 0.0
    for kept_here, whole in zip(kept, blocks):
        peak = max(peak, before + whole)
        before += kept_here
    return profile.rest.at(tokens, square) + max(peak, before)


def gpu_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where == "GPU")


def host_bytes(parts: list[Part]) -> float:
    return sum(part.bytes for part in parts if part.where != "GPU")


@dataclass(frozen=True)
class Plan:
    """The layout chosen, every layout tried on the way (in order), and the parts of the chosen one."""

    layout: Layout
    start: Layout
    tried: list[tuple[str, Layout, float]]  # (step, layout, GPU bytes)
    parts: list[Part]
    gpu_budget: float | None
    host_budget: float | None
    fits: bool
    why: str

    @property
    def gpu_bytes(self) -> float:
        return gpu_bytes(self.parts)


def steps(job: Job, start: Layout, fixed: set[str], host_budget: float | None) -> list[tuple[str, Layout]]:
    """The layouts to try, each one step more memory-saving (and slower) than the one before."""
    out = [("as configured", start)]
    layout = start

    def step(name: str, **changes) -> None:
        nonlocal layout
        layout = dataclasses.replace(layout, **changes)
        out.append((name, layout))

    if "ac" not in fixed:
        for ac in ac_ladder(job, layout.ac):
            step(describe_ac(ac), ac=ac)
    if job.fsdp and "reshard" not in fixed and not layout.reshard:
        step("FSDP reshard after forward", reshard=True)
    if job.can_offload and "offload" not in fixed and not layout.offload and job.optimizer != "Muon":
        moved = host_bytes(estimate(job, dataclasses.replace(layout, offload=True)))
        if host_budget is None or moved <= host_budget:
            step("CPU offload", offload=True)
    if "micro_batches" not in fixed:
        for count in range(layout.micro_batches + 1, job.rows + 1):
            if job.rows % count == 0:
                step(f"{count} micro-batches", micro_batches=count)
    return out


def ac_ladder(job: Job, current: str) -> list[str]:
    """The activation checkpointing settings to try after ``current``, each recomputing more.

    Blocks of PyTorch ops (the meta forward measured them) try op-level selective AC, which keeps
    the matmul outputs and recomputes the cheap rest, then full AC. Blocks that run Triton
    kernels (fla's; a formula estimates them) skip op-level AC: torchtitan's policy keeps only
    PyTorch ops' outputs, so it recomputes every kernel; mamba2 340M on an H100 ran 40k tok/s
    with it, 56k with full AC and 65k checkpointing every second block (docs/perf-log.md,
    2026-11-27). They checkpoint every 4th, 3rd, then 2nd block, then all.
    """
    if job.activations.measured:
        ladder = ["op", "full"]
    else:
        ladder = [str(every) for every in (4, 3, 2) if every <= len(job.activations.blocks)] + ["full"]
    return [ac for ac in ladder if _recompute_rank(ac) > _recompute_rank(current)]


def _recompute_rank(ac: str) -> float:
    """About how much of the forward an AC setting recomputes, for ordering: none 0, every N-th block 1/N, all 1."""
    ranks = {"none": 0.0, "memory_budget": 0.0, "op": 0.5, "full": 1.0}
    return ranks[ac] if ac in ranks else 1 / int(ac)


def choose(job: Job, start: Layout, fixed: set[str], gpu_budget: float | None, host_budget: float | None) -> Plan:
    """The first layout of ``steps`` whose estimate fits ``gpu_budget`` (no budget: ``start``, unchanged)."""
    tried = []
    for name, layout in steps(job, start, fixed, host_budget):
        parts = estimate(job, layout)
        tried.append((name, layout, gpu_bytes(parts)))
        if gpu_budget is None:
            return Plan(layout, start, tried, parts, None, host_budget, True, "no device memory to fit: nothing changed")
        if gpu_bytes(parts) <= gpu_budget:
            why = "fits as configured" if layout == start else (
                f"{gpu_bytes(parts) / GIB:.2f} GiB fits the {gpu_budget / GIB:.2f} GiB budget; "
                f"{tried[-2][0]} needed {tried[-2][2] / GIB:.2f} GiB")
            return Plan(layout, start, tried, parts, gpu_budget, host_budget, True, why)
    smallest = tried[-1][2]
    return Plan(tried[-1][1], start, tried, parts, gpu_budget, host_budget, False,
                f"needs {smallest / GIB:.2f} GiB with {tried[-1][1].describe()}")


def count_params(model: nn.Module, blocks: nn.ModuleList) -> tuple[int, int, int]:
    """(all parameters, the blocks' matrices, the largest block's parameters), tied weights once."""
    total = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in blocks.parameters() if p.dim() == 2)
    largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    return total, matrices, largest


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
    return "\n".join(lines)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()
