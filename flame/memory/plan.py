"""The memory plan: the fastest layout whose estimate (``flame.memory.estimate``) fits the budgets.

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

from flame.memory.estimate import GIB, Part, estimate, gpu_bytes, host_bytes
from flame.memory.layout import FIRST, Job, Layout, first_blocks
from flame.memory.price import Price, price, recompute_share

if TYPE_CHECKING:
    from flame.memory.hardware import Hardware

ALTERNATIVES_SHOWN = 3  # the plan's table names this many of the next cheapest layouts that fit
HOST_SHARE = 0.9  # of the available RAM, the host budget's default: the rest for the data loaders, page cache, the OS
PRICE_TOLERANCE = 0.05  # layouts priced this close count as equal: the one that changes the job least wins


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
    remark: str = ""  # a plan that does not fit: what else was near (``host_bound``)

    @property
    def gpu_bytes(self) -> float:
        return gpu_bytes(self.parts)


def candidates(job: Job, start: Layout, fixed: set[str], host_budget: float | None) -> list[Layout]:
    """Every layout the plan may take from ``start``: each setting the job does not give, in each allowed value.

    Activation checkpointing only recomputes more than ``start`` does (``ac_options``). Offload
    needs a GPU job that FSDP can wrap, an optimizer that runs offloaded (its record says), and room in
    the host budget; so does the optimizer on the host, which a pipeline cannot take. Both together
    stream the weights: FSDP2 keeps them on the host and the host steps them in place while the next
    forward runs (flame.optim.host). Streaming (flame.optim.streaming) keeps them there too, in place of both: each
    block's weights visit the GPU in the compute dtype as it runs. Micro-batches divide the rows evenly. The inputs
    full AC keeps may wait on the host (flame.distributed.activation_offload), on a GPU job that is not pipelined.
    """
    acs = [start.ac] if "ac" in fixed else [start.ac, *ac_options(job, start.ac)]
    reshards = [start.reshard] + ([True] if job.fsdp and "reshard" not in fixed and not start.reshard else [])

    def fits_host(**change) -> bool:
        return host_budget is None or host_bytes(estimate(job, dataclasses.replace(start, **change))) <= host_budget

    offloads = [start.offload]
    if job.can_offload and "offload" not in fixed and not start.offload and job.optimizer.offloads and fits_host(
            offload=True, host_optimizer=False):
        offloads.append(True)
    on_host = [start.host_optimizer]
    if job.can_step_on_host and "host_optimizer" not in fixed and not start.host_optimizer and fits_host(
            host_optimizer=True):
        on_host.append(True)
    counts = [start.micro_batches] + ([] if "micro_batches" in fixed else [
        count for count in range(start.micro_batches + 1, job.rows + 1) if job.rows % count == 0])
    parks = [start.park_inputs] + ([True] if job.can_park_inputs and "park_inputs" not in fixed and not start.park_inputs
                                   else [])
    streams = [start.stream] + ([True] if job.can_stream and "stream" not in fixed and not start.stream and fits_host(
        stream=True, offload=False, host_optimizer=False) else [])
    layouts = [Layout(ac=ac, reshard=reshard, offload=offload, micro_batches=count, host_optimizer=host, park_inputs=park,
                      stream=stream)
               for ac in acs for reshard in reshards for offload in offloads for count in counts for host in on_host
               for park in parks for stream in streams
               if not (stream and (offload or host))]  # streaming is its own offload, with its own host step
    # inputs park only where full AC keeps them, and only where the host has room for them
    return [layout for layout in layouts
            if not layout.park_inputs or ((layout.ac == "full" or first_blocks(layout.ac) is not None)
                                          and (layout == start or fits_host(**dataclasses.asdict(layout))))]


def host_bound(job: Job, start: Layout, fixed: set[str], gpu_budget: float, host_budget: float | None,
               smallest: float) -> str:
    """What a layout that keeps more on the host (the weights offloaded or streamed, with full AC, the checkpointed
    inputs parked there too) would need where the host budget ruled it out: the one needing least host memory
    among those that fit the GPU, else among those needing less GPU memory than ``smallest`` (what the refusal
    names). A remark for the refusal; empty where no such layout helps."""
    if host_budget is None:
        return ""
    ac = start.ac if "ac" in fixed else "full"
    weights = []
    if start.offload or (job.can_offload and job.optimizer.offloads and "offload" not in fixed and not start.stream):
        host = start.host_optimizer or (job.can_step_on_host and "host_optimizer" not in fixed)
        weights.append(dataclasses.replace(start, ac=ac, offload=True, host_optimizer=host))
    if start.stream or (job.can_stream and "stream" not in fixed and not start.offload and not start.host_optimizer):
        weights.append(dataclasses.replace(start, ac=ac, stream=True))
    parks = job.can_park_inputs and "park_inputs" not in fixed
    layouts = weights + [dataclasses.replace(layout, park_inputs=True) for layout in weights if parks]
    over = [(gpu_bytes(parts), host_bytes(parts), layout) for layout in layouts
            if host_bytes(parts := estimate(job, layout)) > host_budget]
    budget = (f"over the {host_budget / GIB:.1f} GiB host budget (--memory.host_budget_gib; auto: {HOST_SHARE:.0%} "
              "of the RAM available)")
    if fitting := [pair for pair in over if pair[0] <= gpu_budget]:
        _, host, layout = min(fitting, key=lambda pair: pair[1])
        return f"; {layout.describe()} would fit the GPU but needs {host / GIB:.1f} GiB of host memory, {budget}"
    if smaller := [pair for pair in over if pair[0] < smallest]:
        gpu, host, layout = min(smaller, key=lambda pair: pair[1])
        return (f"; {layout.describe()} would need {gpu / GIB:.2f} GiB of GPU memory and {host / GIB:.1f} GiB of "
                f"host memory, {budget}")
    return ""


def ac_options(job: Job, current: str) -> list[str]:
    """The activation checkpointing settings that recompute more than ``current``, least first.

    The options are full AC of the first K blocks, for each K, and of all: any share of the blocks
    recomputed, where torchtitan's every-N-th-block AC offers a half, a third, a quarter.
    Checkpointing the first blocks rather than every N-th keeps the last ones whole, and their
    backward runs first: the backward's peak is then the forward's, where a recomputed last block
    adds its activations on top (``activation_bytes``).

    Never op-level selective AC: torchtitan's policy keeps only PyTorch ops' outputs, so it runs
    again every Triton kernel of fla's blocks and most of an HF block, and measured slower than
    full AC while keeping more (docs/perf-log.md, 2026-11-27). A job may still give it.
    """
    blocks = len(job.activations.blocks)
    firsts = [f"{FIRST}{count}" for count in range(1, blocks)]
    options = ([str(every) for every in (4, 3, 2) if every <= blocks] if job.pipelined else firsts) + ["full"]
    here = recompute_share(current, blocks)
    return [ac for ac in options if recompute_share(ac, blocks) > here]


def _changes(start: Layout, layout: Layout, blocks: int) -> tuple:
    """How far a layout strays from ``start``, for choosing between layouts priced alike: offload, then streaming,
    then the optimizer on the host, then parked inputs, then micro-batches, then resharding, then recomputation, the
    changes a user notices most first."""
    return (layout.offload != start.offload, layout.stream != start.stream, layout.host_optimizer != start.host_optimizer,
            layout.park_inputs != start.park_inputs, layout.micro_batches, layout.reshard != start.reshard,
            recompute_share(layout.ac, blocks))


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
                    f"needs {smallest.gpu_bytes / GIB:.2f} GiB with {smallest.layout.describe()}", hardware,
                    host_bound(job, start, fixed, gpu_budget, host_budget, smallest.gpu_bytes))
    cheapest = fitting[0].price.seconds
    alike = [candidate for candidate in fitting if candidate.price.seconds <= cheapest * (1 + PRICE_TOLERANCE)]
    chosen = min(alike, key=lambda candidate: _changes(start, candidate.layout, blocks))
    unplanned = price(job, start, hardware).seconds
    if len(fitting) == 1:
        among = "the only layout that fits"
    elif chosen is fitting[0]:
        among = f"the cheapest of {len(fitting)} layouts that fit"
    else:  # priced alike (within the rates' noise): the one that changes the job least
        among = (f"of {len(fitting)} layouts that fit, priced within {PRICE_TOLERANCE:.0%} of the cheapest "
                 f"({cheapest:.3g} s) with fewer changes to the job")
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
