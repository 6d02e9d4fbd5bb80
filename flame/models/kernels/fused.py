"""Fused kernels for the elementwise parts of HF decoders: RMS norms, SiLU-gated MLPs, rotary embeddings.

In eager code an HF decoder block spends much of its time outside its matmuls: its RMSNorm is
seven kernels (upcast, square, mean, add, rsqrt, two products), its rotary embedding about six
per query and key, its MLP's SiLU and product two more, each reading and writing whole
activations, and backward as many again. ``use_fused_kernels`` gives the modules of a model
flame builds (HF models; fla's are fused already) fused kernels instead:

- RMS norms: torch's ``F.rms_norm``, one fused CUDA kernel each way (composite ops on CPU).
  Statistics in fp32 and the output dtype as HF's; the output is rounded once, where HF rounds
  the normalized value and then its product with the weight.
- SiLU-gated MLPs, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: on CUDA, fla's
  ``swiglu_linear``: SiLU and product in one kernel, whose result the down projection takes
  and backward recomputes rather than keeping (one [tokens, intermediate] activation per block
  less memory).
- rotary embeddings: on CUDA, fla's rotary kernel, one per tensor each way, in place of the
  modeling module's ``apply_rotary_pos_emb`` (flame.compat.transformers.fused_rotary). Under
  autocast HF promotes q and k to fp32 here, only for the attention to cast them back; the
  fused rotation keeps them in q's dtype (the tables rounded to it, as without autocast).

What qualifies is decided by what a class computes, not by its name: each candidate (norms:
a class named ...RMSNorm holding a ``weight`` and a ``variance_epsilon``; MLPs: Linear
``gate_proj``/``up_proj``/``down_proj``; rotary: a modeling module's ``apply_rotary_pos_emb``) first
runs on a small CPU probe against the fused computation; one that computes something else
(a ``(1 + weight)`` norm, a GELU-gated MLP, interleaved rotary) keeps its own code.

A module keeps its parameters, names and class name (its fused class subclasses the original
class), so state dicts, checkpoints, tensor-parallel plans, weight init and exports see the
model HF builds. Compiled blocks (--training.compile) run HF's code: the compiler fuses it
itself, and fla's kernels would be opaque to it. --model.no-fused_kernels keeps HF's code.
"""

import functools
import importlib
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from flame import compat

from flame.base import device
from flame.compat.fla import FLA
from flame.compat.guard import Target
from flame.models import registry
from flame.models.kernels.meta_keeps import Keeps

# fla's kernels the CUDA paths call
_SWIGLU_LINEAR = Target(FLA, "fla.modules.activations", "swiglu_linear", ("x", "y", "weight", "bias"))
_SWIGLU = Target(FLA, "fla.modules.activations", "swiglu")
_ROTARY = Target(FLA, "fla.modules.rotary", "rotary_embedding", ("x", "cos", "sin", "interleaved", "inplace"))


@functools.cache
def _fla_kernels() -> SimpleNamespace:
    registry.import_fla()  # flame's one import of fla (it applies flame's changes to fla)
    for target in (_SWIGLU_LINEAR, _SWIGLU, _ROTARY):
        target.require("flame.models.kernels.fused")
    return SimpleNamespace(swiglu_linear=_SWIGLU_LINEAR.resolve(), swiglu=_SWIGLU.resolve(),
                           rotary=_ROTARY.resolve())


def prepare_kernels() -> None:
    """On CUDA, import fla and check the kernels the fused paths call: before the model is built (the
    build runs on the meta device), rather than in the first step. ConfigError if fla lacks them."""
    if device.CUDA:
        _fla_kernels()


def _eager_on_cuda(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and not torch.compiler.is_compiling()


# --- what the CUDA kernels keep, on meta tensors (flame.memory's activation measurement) ---------

_keeping_as_on_cuda = False


@contextmanager
def kept_as_on_cuda():
    """Inside, a forward on meta tensors keeps for its backward what the fused CUDA kernels keep.

    flame.memory measures activations by a meta forward's saved tensors; without this it would
    see HF's code (the fused kernels need real memory), which keeps more: an fp32 copy of each
    norm's input, and the SiLU product of each MLP.
    """
    global _keeping_as_on_cuda
    before, _keeping_as_on_cuda = _keeping_as_on_cuda, True
    try:
        yield
    finally:
        _keeping_as_on_cuda = before


def _keeping_on_meta(x: torch.Tensor) -> bool:
    return _keeping_as_on_cuda and x.device.type == "meta"


# --- RMS norms -------------------------------------------------------------------------------


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return self.fused_from.forward(self, hidden_states)
    # HF's output dtype: its product of the weight and the input-dtype result
    dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    if _keeping_on_meta(hidden_states):  # the CUDA kernel keeps its input and the fp32 inverse RMS per row
        x, inverse_rms = hidden_states.to(dtype), torch.empty(hidden_states.shape[:-1], dtype=torch.float32, device="meta")
        return Keeps.apply(x, x, inverse_rms)
    device_type = hidden_states.device.type
    # autocast leaves HF's elementwise ops alone; it must not recast the fused op either
    with torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext():
        return F.rms_norm(hidden_states.to(dtype), self.weight.shape, self.weight.to(dtype), self.variance_epsilon)


def _is_rms_norm(module: nn.Module) -> bool:
    params = dict(module.named_parameters())
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "variance_epsilon", None), float)
            and list(params) == ["weight"] and params["weight"].ndim == 1 and not list(module.buffers()))


def _norm_matches(module: nn.Module) -> bool:
    """HF's forward of this class against the fused one on a probe: values and output dtype, in fp32, and
    bf16 inputs with bf16 and fp32 weights (FSDP's and autocast's mixed precision)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(module.weight.shape, generator=generator, dtype=torch.float32)
    x = torch.randn(2, 3, weight.shape[0], generator=generator, dtype=torch.float32) * 3
    for x_dtype, weight_dtype, tolerance in ((torch.float32, torch.float32, 1e-5),
                                             (torch.bfloat16, torch.bfloat16, 2e-2),
                                             (torch.bfloat16, torch.float32, 2e-2)):
        probe = _probe(module, {"weight": nn.Parameter(weight.to(weight_dtype))})
        expected, got = type(module).forward(probe, x.to(x_dtype)), _rms_norm_forward(probe, x.to(x_dtype))
        if got.dtype != expected.dtype or not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
            return False
    return True


# --- SiLU-gated MLPs -------------------------------------------------------------------------

_GATED_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def _gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    on_meta = _keeping_on_meta(x)
    if not (on_meta or _eager_on_cuda(x)):
        return self.fused_from.forward(self, x)
    gate, up, down = self.gate_proj(x), self.up_proj(x), self.down_proj
    # the fused down projection reads down_proj's weight itself: only a plain Linear's forward is that
    fused_down = type(down) is nn.Linear and not (down._forward_hooks or down._forward_pre_hooks)
    if on_meta:  # both kernels keep the gate and up projections; swiglu_linear recomputes their product, swiglu
        # hands it to the down projection, which keeps it where it has to (a LoRA adapter's input, a float8 Linear's)
        if fused_down:
            return Keeps.apply(x.new_empty((*x.shape[:-1], down.out_features), dtype=gate.dtype), gate, up)
        return down(Keeps.apply(gate, gate, up))
    kernels = _fla_kernels()
    if fused_down:
        # in the activations' dtype, as autocast would give F.linear (a no-op without autocast)
        weight, bias = down.weight.to(gate.dtype), down.bias.to(gate.dtype) if down.bias is not None else None
        return kernels.swiglu_linear(gate, up, weight, bias)
    return down(kernels.swiglu(gate, up))  # e.g. a float8 Linear, a LoRA adapter's


def _is_gated_mlp(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return (all(type(children.get(name)) is nn.Linear for name in _GATED_MLP_LINEARS)
            and all(name.split(".")[0] in _GATED_MLP_LINEARS for name, _ in module.named_parameters()))


def _mlp_matches(module: nn.Module) -> bool:
    """HF's forward of this class against down(silu(gate(x)) * up(x)), on a probe with small Linears."""
    generator = torch.Generator().manual_seed(0)

    def linear(name: str, inputs: int, outputs: int) -> nn.Linear:
        with torch.device("meta"):
            layer = nn.Linear(inputs, outputs, bias=getattr(module, name).bias is not None)
        layer.weight = nn.Parameter(torch.randn(outputs, inputs, generator=generator, dtype=torch.float32) / inputs**0.5)
        if layer.bias is not None:
            layer.bias = nn.Parameter(torch.randn(outputs, generator=generator, dtype=torch.float32))
        return layer

    probe = _probe(module, {}, {"gate_proj": linear("gate_proj", 8, 12), "up_proj": linear("up_proj", 8, 12),
                                "down_proj": linear("down_proj", 12, 8)})
    x = torch.randn(2, 3, 8, generator=generator, dtype=torch.float32)
    expected = probe.down_proj(F.silu(probe.gate_proj(x)) * probe.up_proj(x))
    return torch.allclose(type(module).forward(probe, x), expected, rtol=1e-5, atol=1e-6)


# --- rotary embeddings -----------------------------------------------------------------------


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether fla's kernel takes these arguments: [B, H, L, D] queries and keys, [B or 1, L, D] tables."""
    if not _eager_on_cuda(q) or q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return False
    rows, _, length, dim = q.shape
    if k.shape[0] != rows or k.shape[2:] != (length, dim) or cos.shape[1:] != (length, dim) or cos.shape[0] not in (1, rows):
        return False
    if dim % 2 or dim > 256 or k.dtype != q.dtype or sin.dtype != cos.dtype:
        return False
    # tables of another dtype: HF's product promotes; under autocast that only feeds the attention's cast
    return cos.dtype == q.dtype or torch.is_autocast_enabled(q.device.type)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Callable) -> torch.Tensor:
    # fla's kernel rotates [1, T, H, D] tokens by row t of [T, D/2] tables: every token gets its own
    # row (its position's angles), so any position ids (restarting documents, context-parallel
    # shards) are taken as they are. HF's q/k are [B, H, L, D] views of [B, L, H, D] memory.
    rows, heads, length, dim = x.shape
    tokens = x.transpose(1, 2).reshape(1, rows * length, heads, dim)
    return rotary(tokens, cos, sin).view(rows, length, heads, dim).transpose(1, 2)


def _half_table(table: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    # HF's tables hold each angle twice (cat(freqs, freqs)); the kernel takes one half
    length, dim = table.shape[1:]
    return table[..., : dim // 2].expand(rows, length, dim // 2).reshape(rows * length, dim // 2).to(dtype).contiguous()


def fuse_rotary(original: Callable) -> Callable:
    """``original`` (a modeling module's apply_rotary_pos_emb) through fla's kernel where it can run it."""
    if getattr(original, "fused_by_flame", False):
        return original

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not _rotary_fits(q, k, cos, sin):
            return original(q, k, cos, sin, *args, **kwargs)
        rotary = _fla_kernels().rotary
        cos, sin = (_half_table(table, q.shape[0], q.dtype) for table in (cos, sin))
        return _rotate(q, cos, sin, rotary), _rotate(k, cos, sin, rotary)

    apply_rotary_pos_emb.fused_by_flame = True
    return apply_rotary_pos_emb


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What fla's kernel computes for [B, H, L, D] ``x`` and [B, L, D] tables: each half-pair rotated by the first half's angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rotary_matches(function: Callable) -> bool:
    """A modeling module's apply_rotary_pos_emb against rotary_reference, on a probe."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, 5, 8, generator=generator, dtype=torch.float32) for heads in (4, 2))
    angles = torch.rand(2, 5, 4, generator=generator, dtype=torch.float32) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got = function(q, k, cos, sin)
    return all(torch.allclose(g, rotary_reference(x, cos, sin), rtol=1e-5, atol=1e-6) for g, x in zip(got, (q, k)))


@functools.cache
def _rotary_fusable(module_name: str) -> bool:
    """Whether ``module_name`` has an apply_rotary_pos_emb that fla's kernel computes (decided once per module)."""
    function = getattr(importlib.import_module(module_name), compat.transformers.ROTARY, None)
    if not callable(function) or compat.transformers.rotary_target(module_name).problem():
        return False  # none, or another signature: not the function fla's kernel replaces
    return _verdict(_rotary_matches, function)


# --- the swap --------------------------------------------------------------------------------


def _probe(module: nn.Module, params: dict[str, nn.Parameter], children: dict[str, nn.Module] | None = None):
    """An instance of ``module``'s class with its plain attributes and its other children, and these small
    parameters and children, on the CPU: HF's forward of the class can run on it."""
    probe = type(module).__new__(type(module))
    nn.Module.__init__(probe)
    probe.__dict__.update({name: value for name, value in vars(module).items() if not name.startswith("_")})
    children = children or {}
    for name, child in module.named_children():
        probe.add_module(name, children.get(name, child))
    for name, param in params.items():
        probe.register_parameter(name, param)
    return probe


def _verdict(check: Callable[[object], bool], subject: object) -> bool:
    with torch.device("cpu"), torch.no_grad():  # builds run under torch.device("meta")
        try:
            return check(subject)
        except Exception:  # noqa: BLE001 - code that fails on the probe keeps its own code
            return False


@functools.cache
def _fused_class(original: type, forward: Callable) -> type:
    # same name and module as the original: transformers initializes norms by class name, and
    # every isinstance check of the original class still holds
    return type(original.__name__, (original,), {"__module__": original.__module__, "forward": forward,
                                                 "fused_from": original})


@dataclass
class Fused:
    """What use_fused_kernels changed in one model."""

    norms: dict[str, int] = field(default_factory=dict)  # class name -> modules
    mlps: dict[str, int] = field(default_factory=dict)
    rotary: list[str] = field(default_factory=list)  # modeling modules

    def describe(self) -> str:
        on_cuda = "" if device.CUDA else " on CUDA (HF's code on this CPU)"
        parts = [f"{count} {name} -> torch's rms_norm" for name, count in self.norms.items()]
        parts += [f"{count} {name} -> fla's swiglu_linear{on_cuda}" for name, count in self.mlps.items()]
        parts += [f"{module.rpartition('.')[2]}.apply_rotary_pos_emb -> fla's rotary kernel{on_cuda}"
                  for module in self.rotary]
        what = "; ".join(parts) or "none (no RMS norm, SiLU-gated MLP or rotary embedding they compute)"
        return f"Fused kernels for eager code (compiled blocks run HF's own): {what}"


_CANDIDATES: list[tuple[str, Callable[[nn.Module], bool], Callable[[nn.Module], bool], Callable]] = [
    ("norms", _is_rms_norm, _norm_matches, _rms_norm_forward),
    ("mlps", _is_gated_mlp, _mlp_matches, _gated_mlp_forward),
]
# (class, its children's types: an MLP's activation comes from the config) -> whether it computes
# what its fused forward does
_verdicts: dict[tuple, bool] = {}


def use_fused_kernels(model: nn.Module) -> Fused:
    """Give ``model``'s RMS norms, SiLU-gated MLPs and rotary embeddings fused kernels (before parallelizing)."""
    fused = Fused()
    for module in model.modules():
        cls = type(module)
        if hasattr(cls, "fused_from"):
            continue
        for kind, candidate, matches, forward in _CANDIDATES:
            if not candidate(module):
                continue
            key = (cls, tuple((name, type(child)) for name, child in module.named_children()))
            if key not in _verdicts:
                _verdicts[key] = _verdict(matches, module)
            if _verdicts[key]:
                module.__class__ = _fused_class(cls, forward)
                counts = getattr(fused, kind)
                counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
            break
    for name in sorted({type(module).__module__ for module in model.modules()}):
        if _rotary_fusable(name):
            compat.transformers.fused_rotary(name)(fuse_rotary)
            fused.rotary.append(name)
    return fused
