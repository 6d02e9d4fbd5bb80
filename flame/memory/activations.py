"""Activation memory measured from the architecture, on the meta device.

The model is built on the meta device (no memory) in the job's compute dtype, and one row runs
forward under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for the
backward passes through the hook, and its storage's bytes are summed, once per storage (a view
saved twice, or one output saved by two ops, counts once), weights left out. Forward hooks on
each decoder block attribute what is saved between its start and its end to that block, and
the rest (embeddings, final norm, head input) to the model around them. A dispatch mode counts,
in the same forward, the outputs that torchtitan's op-level selective AC policy keeps (its save
list, every second ``mm`` recomputed), so op-level AC is measured the same way.
A GPU job's eager HF blocks run flame's fused norms and MLPs (flame.models.kernels.fused), whose kernels
keep less than HF's code; their meta forward keeps what those kernels keep (``fused``).

Runs at three row lengths fit ``bytes = a + b·T + c·T²`` per block exactly: ``c`` is the T x T
attention weights that PyTorch's math SDPA path (the one meta tensors take) keeps per head;
flash-style kernels (flame's ``varlen`` and ``flex`` attention) keep a per-row logsumexp instead,
so the planner counts ``c`` only for ``sdpa`` attention. For a job on those kernels an HF model's
meta forward attends through flame's attention, which on meta tensors keeps what the kernel keeps
(flame.models.kernels.attention.kept_as_flash_kernels): without it, the math path's float32 copies of the
queries, keys and values would count too.

Models whose forward cannot run on meta tensors (fla's Triton kernels), and jobs under autocast
(which meta tensors do not take), are measured on the GPU instead, by the same hooks
(``flame.memory.probe``); on a GPU the hooks also read what the last block's backward allocates
beyond what it kept (``backward_peak``), which the meta forward cannot: there it counts as
nothing, which the allocator margin has to cover. Where there is no GPU, or the probe of a model
the meta forward could not run fails, a stated formula stands in (``FALLBACK_TENSORS_PER_HIDDEN``);
the plan's table says which applies.

Not counted: the forward's transient buffers, cuBLAS/NCCL workspaces.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PretrainedConfig

from flame import compat
from flame.models import experts, lora
from flame.models.kernels import attention as attention_kernels
from flame.models.kernels.fused import kept_as_on_cuda, use_fused_kernels
from flame.models.inputs import flattens_rows
from flame.models.registry import decoder_layers, meta_model

LENGTHS = (32, 64, 128)  # three row lengths fit a + b·T + c·T² exactly; short enough for learned position tables
# per token per block, in units of hidden_size x dtype bytes, when the forward cannot run on meta tensors:
# about 17 hidden-sized tensors per block (q, k, v, attention output, the MLP's 4x-wide inputs and
# products, norms' inputs), the usual count for a transformer block without its T x T weights
FALLBACK_TENSORS_PER_HIDDEN = 17


@dataclass(frozen=True)
class Quadratic:
    """``linear·T + square·T²`` bytes for one row of T tokens (the constant term is dropped)."""

    linear: float = 0.0
    square: float = 0.0

    def at(self, tokens: int, with_square: bool = True) -> float:
        return self.linear * tokens + (self.square * tokens * tokens if with_square else 0.0)

    def __add__(self, other: Quadratic) -> Quadratic:
        return Quadratic(self.linear + other.linear, self.square + other.square)


@dataclass(frozen=True)
class ActivationProfile:
    """What one row keeps for the backward, per block (all blocks listed) and around the blocks."""

    blocks: tuple[Quadratic, ...]  # everything a block saves (no AC)
    selective: tuple[Quadratic, ...]  # what op-level selective AC keeps of each block
    block_input: float  # bytes per token of a block's input: all that full AC keeps of it
    rest: Quadratic  # embeddings, final norm, head input
    method: str  # how it was found, for the plan's table
    backward: Quadratic = Quadratic()  # what a block's backward allocates beyond what it kept (GPU probe only)
    triton_kernels: bool = False  # the forward launches Triton kernels of its own (fla's), which tune on a new machine

    def scaled(self, blocks: int) -> ActivationProfile:
        """The same blocks, ``blocks`` of them (the first ones, repeated): for tests of the scaling."""
        take = [self.blocks[i % len(self.blocks)] for i in range(blocks)]
        sel = [self.selective[i % len(self.selective)] for i in range(blocks)]
        return dataclasses.replace(self, blocks=tuple(take), selective=tuple(sel))


class _SelectiveCounter(TorchDispatchMode):
    """Sums the output bytes of the ops torchtitan's op-level SAC policy saves, per block."""

    def __init__(self, save_list: set):
        super().__init__()
        self.save_list = save_list
        self.block: int | None = None
        self.mm_count = 0
        self.saved: dict[int, int] = {}

    def start_block(self, index: int) -> None:
        self.block, self.mm_count = index, 0  # the policy counts mms per checkpointed block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is None or func not in self.save_list:
            return out
        if func == torch.ops.aten.mm.default:
            self.mm_count += 1
            if self.mm_count % 2 == 0:  # the policy recomputes every second mm
                return out
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.saved[self.block] = self.saved.get(self.block, 0) + tensor.untyped_storage().nbytes()
        return out


def _saved_per_block(model: nn.Module, tokens: int, save_list: set,
                     where: torch.device | str = "meta") -> tuple[list[int], list[int], int, int, int]:
    """(bytes each block saves, bytes op-level SAC keeps of each, bytes saved outside blocks, block input bytes,
    bytes the last block's backward allocates: 0 on the meta device)."""
    layers = decoder_layers(model)
    weights = {p.untyped_storage()._cdata for p in model.parameters()} | {
        b.untyped_storage()._cdata for b in model.buffers()
    }
    seen: set[int] = set()
    per_block = [0] * len(layers)
    outside = 0
    state = {"block": None, "input": 0, "last": None}
    counter = _SelectiveCounter(save_list)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        storage = tensor.untyped_storage()
        if storage._cdata not in weights and storage._cdata not in seen:
            seen.add(storage._cdata)
            if state["block"] is None:
                outside += storage.nbytes()
            else:
                per_block[state["block"]] += storage.nbytes()
        # detached: an op's output saved as itself would hold its own grad_fn, a cycle the collector cannot see
        return tensor.detach()

    def enter(index: int):
        def hook(module, args, kwargs):
            state["block"] = index
            counter.start_block(index)
            hidden = args[0] if args else kwargs.get("hidden_states")
            state["input"] = hidden.untyped_storage().nbytes()
            state["last"] = hidden
            counter.__enter__()  # inside blocks only: the model's mask code calls .item() under any dispatch mode

        return hook

    def leave(module=None, args=None, output=None) -> None:
        if module is layers[-1]:
            state["last"] = (state["last"], output[0] if isinstance(output, (tuple, list)) else output)
        if state["block"] is not None:
            state["block"] = None
            counter.block = None
            counter.__exit__(None, None, None)

    handles = [block.register_forward_pre_hook(enter(i), with_kwargs=True) for i, block in enumerate(layers)]
    handles += [block.register_forward_hook(leave) for block in layers]
    ids = torch.zeros(1, tokens, dtype=torch.long, device=where)
    # fla's models as the trainer calls them (flame.models.inputs): no KV cache, and their document
    # boundaries given, so that the GPU probe's kernels tune under the keys the training's forward reads
    inputs = {}
    if flattens_rows(model):
        inputs = {"use_cache": False, "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32, device=where)}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids, **inputs)
        if torch.device(where).type == "cuda":
            block_input, block_output = state["last"]
            workspace = backward_peak(block_output, [block_input])
        else:
            workspace = 0
    finally:
        # a block that raised (a refused Triton launch) never reached its forward hook: left on the
        # stack, the counting mode would run every later op of the process through Python (a third
        # of the training's speed)
        leave()
        for handle in handles:
            handle.remove()
        # the graph's saved tensors keep ``pack`` (autograd holds both hooks), and through its closure this
        # state: a cycle through C++ that Python's collector cannot see, which would keep the whole forward
        # (the model's weights included) alive for the rest of the process
        state["last"] = None
    selective = [counter.saved.get(i, 0) for i in range(len(layers))]
    return per_block, selective, outside, state["input"], workspace


def backward_peak(output: torch.Tensor, wanted: list[torch.Tensor], retain_graph: bool = False) -> int:
    """Bytes a backward from ``output`` (a gradient of ones arriving) to ``wanted`` allocates at its peak beyond
    what is live when it starts (the saved tensors and that gradient): the gradients it passes on and its kernels'
    buffers. The probe asks a block for its input's gradient alone: the weights' gradients do not grow with the
    row (the plan counts them itself), and asked for they set the peak of the probe's short rows (a 7B block's
    outweighed its per-token buffers there, and the rows' fit then sloped down: docs/perf-log.md)."""
    where = output.device
    arriving = torch.ones_like(output)
    torch.cuda.synchronize(where)
    start = torch.cuda.memory_allocated(where)
    torch.cuda.reset_peak_memory_stats(where)
    torch.autograd.grad(output, wanted, arriving, retain_graph=retain_graph)
    return torch.cuda.max_memory_allocated(where) - start


def _slope(values: list[float], lengths: tuple[int, int, int]) -> Quadratic:
    """The per-token growth between the two longest rows: a backward's buffers grow in step with the row (flash-style
    attention keeps no T x T term), and a fixed buffer may still set the shortest row's peak."""
    return Quadratic(max(0.0, (values[2] - values[1]) / (lengths[2] - lengths[1])))


def _fit(values: list[float], lengths: tuple[int, int, int] = LENGTHS) -> Quadratic:
    """The b·T + c·T² through three measurements at ``lengths`` (exact: three points, three coefficients)."""
    (t1, t2, t3), (y1, y2, y3) = lengths, values
    # second divided difference gives c; then b from the first two points
    c = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)
    b = (y2 - y1) / (t2 - t1) - c * (t1 + t2)
    return Quadratic(b, c)


_PROFILES: dict[tuple, ActivationProfile] = {}


def measure(config: PretrainedConfig, dtype: torch.dtype, fused: bool = False,
            autocast: bool = False, attention: str = "sdpa", adapters: lora.LoraSettings | None = None) -> ActivationProfile:
    """The activation profile of ``config``'s model computing in ``dtype`` (cached per argument).

    ``fused``: the job runs an HF model's norms and MLPs on flame's fused CUDA kernels
    (flame.models.kernels.fused, eager on a GPU): the meta forward keeps what those kernels keep.
    ``autocast``: the job keeps float32 weights and computes under autocast to ``dtype`` (no FSDP);
    the GPU probe runs so (autocast does not reach meta tensors: the meta forward runs in ``dtype``).
    ``attention``: the job's attention backend; under ``varlen`` or ``flex`` an HF model's meta forward keeps
    what that kernel keeps (flame.models.kernels.attention.kept_as_flash_kernels), not what math attention keeps.
    ``adapters``: the job's LoRA (--lora.*): its adapters keep their inputs where the frozen base keeps none (the
    product a fused MLP would recompute is then kept as the down projection's adapter input).
    """
    key = (config.to_json_string(use_diff=False), dtype, fused, autocast, attention, adapters)
    if key not in _PROFILES:
        _PROFILES[key] = _measure(config, dtype, fused, autocast, attention, adapters)
    return _PROFILES[key]


def as_trained(model: nn.Module, fused: bool, adapters: lora.LoraSettings | None) -> nn.Module:
    """``model`` (built in the job's precision) with what flame.models.builder adds that changes what its forward
    keeps: flame's experts, the fused norms and MLPs, then LoRA's adapters (PEFT builds them in the base's dtype)."""
    model.train()
    experts.use_flame_experts(model)
    if fused:
        use_fused_kernels(model)
    if adapters is not None:
        lora.add_adapters(model, adapters)
    return model


def _measure(config: PretrainedConfig, dtype: torch.dtype, fused: bool, autocast: bool,
             attention: str, adapters: lora.LoraSettings | None) -> ActivationProfile:
    from flame.memory import probe  # it builds on this module's hooks and fit
    model = as_trained(meta_model(config).to(dtype), fused, adapters)
    flash = attention in ("varlen", "flex") and _takes_flame_attention(model)
    blocks = len(decoder_layers(model))
    try:
        with (compat.triton.kernel_launches_refused(), kept_as_on_cuda() if fused else nullcontext(),
              attention_kernels.kept_as_flash_kernels(attention) if flash else nullcontext()):
            profile = fitted_profile(model, LENGTHS, "meta", "meta-device forward, saved tensors"
                               + (", flame's fused norms and MLPs" if fused else "")
                               + (f", {attention} attention's" if flash else ""))
    except Exception as error:  # noqa: BLE001 - any kernel that needs real memory (Triton) lands here
        refused = isinstance(error, compat.triton.KernelLaunchRefused)
        why = f"reached {error}" if refused else f"failed: {type(error).__name__}"
        if (where := probe.probe_device()) is None:
            profile = _formula(config, dtype, blocks, why)
        else:
            profile = probe.probed(config, dtype, where, autocast, fused, adapters,
                                   otherwise=lambda failed: _formula(config, dtype, blocks, f"{why}; {failed}"))
        return dataclasses.replace(profile, triton_kernels=refused)
    if autocast and (where := probe.probe_device()) is not None:
        # autocast does not reach meta tensors, so that forward kept every tensor in ``dtype``, where the job
        # keeps its residual stream and the norm inputs saved from it in float32: measured as the job runs
        return probe.probed(config, dtype, where, autocast, fused, adapters,
                            otherwise=lambda failed: dataclasses.replace(profile, method=f"{profile.method}; {failed}"))
    return profile


def _takes_flame_attention(model: nn.Module) -> bool:
    """Switch an HF model to flame's attention, as flame.models.builder builds it; False where it has none to switch
    (fla's models call their kernels themselves) or refuses (it then trains on its own attention too)."""
    if not isinstance(getattr(model.config, "_attn_implementation", None), str) or flattens_rows(model):
        return False
    try:
        model.set_attn_implementation(attention_kernels.HF_ATTENTION)
    except (ValueError, AttributeError):
        return False
    return True


def fitted_profile(model: nn.Module, lengths: tuple[int, int, int], where, method: str) -> ActivationProfile:
    """``model``'s forward at each of ``lengths`` tokens on ``where``, its saved tensors fitted per block."""
    save_list = compat.torchtitan.op_sac_save_list()
    runs = [_saved_per_block(model, tokens, save_list, where) for tokens in lengths]
    blocks = len(decoder_layers(model))
    per_block = tuple(_fit([run[0][i] for run in runs], lengths) for i in range(blocks))
    selective = tuple(_fit([run[1][i] for run in runs], lengths) for i in range(blocks))
    rest = _fit([run[2] for run in runs], lengths)
    block_input = runs[-1][3] / lengths[-1]
    backward = _slope([run[4] for run in runs], lengths)
    return ActivationProfile(per_block, selective, block_input, rest, f"measured ({method})", backward)


def _formula(config: PretrainedConfig, dtype: torch.dtype, blocks: int, why: str) -> ActivationProfile:
    hidden = config.hidden_size * torch.tensor([], dtype=dtype).element_size()
    block = Quadratic(FALLBACK_TENSORS_PER_HIDDEN * hidden)
    # op-level SAC keeps the matmul outputs: about a third of them (an assumption, not measured)
    selective = Quadratic(block.linear / 3 + hidden)
    return ActivationProfile(
        (block,) * blocks, (selective,) * blocks, hidden, Quadratic(2 * hidden),
        f"formula ({FALLBACK_TENSORS_PER_HIDDEN} x hidden per token per block; the meta forward {why})",
    )
