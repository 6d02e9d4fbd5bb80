"""FP8 training of linear layers (torchao's Float8Linear), where it is faster than bf16.

    --float8.recipe_name tensorwise [--float8.layers auto|all] [--float8.filter_fqns o_proj,lm_head]

The rule: an FP8 matmul runs at up to twice bf16's rate on Hopper, but each one first scales and
casts its input, its weight and, in the backward, its output gradient to FP8: passes over memory
that cost more than they save when the matmul is small (short rows, narrow layers). So with
``layers auto`` (the default) the model's linear layers are timed on this GPU, forward and backward
at the job's tokens per micro-batch, in bf16 and in FP8 (compiled under --training.compile), and
only those FP8 makes faster are converted (``faster_in_fp8``; measured once per machine and cached
like the memory plan's rates). Where the blocks are compiled, layers that read one input (an
attention's q, k and v; a gated MLP's gate and up) are timed together, as one group: they share the
input's cast. Under --training.compile a type whose blocks stay eager has each converted layer
compiled on its own (``compile_each``): eager, the casts lost to bf16 at every shape measured.
``layers all`` converts every eligible layer.

Eligible: every ``nn.Linear`` whose two dimensions are multiples of 16 (the FP8 GEMM's rule), except
the output head (flame's fused loss reads its weight directly), MoE routers (their top-k choice
turns on small differences), LoRA's adapters (rank-wide matmuls) and ``--float8.filter_fqns``.

FP8 lives inside the matmuls only: the weights, gradients and optimizer state keep their dtypes, so
checkpoints and exports do not change and a run may turn FP8 on or off when it resumes. Under FSDP
with tensorwise scaling the converted weights are all-gathered in FP8 (half of bf16's bytes), their
scales computed together after each optimizer step (``precompute_scales``). CPUs have no FP8
matmul: there the matmuls are emulated (cast to FP8 and back, multiplied in float32), which keeps
the numerics for tests and says nothing about speed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flame import compat
from flame.base import device
from flame.base.errors import ConfigError
from flame.base.measured_once import measured_once
from flame.data.builtin import cache_dir
from flame.models import moe
from flame.models.kernels import attention, fused
from flame.models.registry import layer_kinds, names_layer

OFF = "off"
FASTER_BY = 0.97  # a shape converts when FP8's step takes at most this share of bf16's (ties stay bf16)
_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on


@dataclass(frozen=True)
class Float8Settings:
    """The --float8.* settings a model is converted with (``of`` gives None where FP8 is off)."""

    recipe: str
    layers: str
    skip: tuple[str, ...]
    all_gather: bool  # tensorwise under FSDP: weights all-gathered in FP8
    precompute: bool  # and their scales computed after the optimizer step

    @classmethod
    def of(cls, float8: Any) -> "Float8Settings | None":
        if float8.recipe_name == OFF:
            return None
        return cls(recipe=float8.recipe_name, layers=float8.layers, skip=tuple(name.strip() for name in float8.filter_fqns),
                   all_gather=float8.enable_fsdp_float8_all_gather and float8.recipe_name == "tensorwise",
                   precompute=float8.precompute_float8_dynamic_scale_for_fsdp)


def check_device() -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores (before any model is built); CPUs emulate."""
    if not device.CUDA:
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < _MIN_CAPABILITY:
        raise ConfigError(f"--float8.recipe_name needs FP8 tensor cores (compute capability 8.9+: H100, L40S, RTX 4090); "
                          f"{torch.cuda.get_device_name()} is {major}.{minor}: leave --float8.recipe_name off")


def _torchao_float8():
    """torchao.float8: from the environment, else from FP8's side folder (3rdparty/requirements-fp8.txt says why it
    lives apart: FLAME_FP8_PATH, default <environment>/fp8), appended to the path so that it shadows nothing. Its
    notes about C++ extensions built for other GPUs and torch versions are kept out of the log: it tries them all at
    import, and the FP8 training path is Python and Triton."""
    side = os.environ.get("FLAME_FP8_PATH") or os.path.join(sys.prefix, "fp8")
    if importlib.util.find_spec("torchao") is None and os.path.isdir(side) and side not in sys.path:
        sys.path.append(side)
    # torch's pytree warns as torchao registers its enums the older way
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError(f"--float8.recipe_name needs torchao, found neither in the environment nor in {side}: run "
                          "bash 3rdparty/install.sh (or pip install torchao==0.18.0)") from None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8


def _torchao_version() -> str:
    """The torchao FP8 runs with (in the environment or its side folder: found where ``_torchao_float8`` looks)."""
    _torchao_float8()
    return sys.modules["torchao"].__version__


def eligible_layers(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """The linear layers FP8 may convert, by name: (in_features, out_features). ConfigError for a ``skip`` entry
    (--float8.filter_fqns) that names no linear layer: a misspelt name would leave the layer in FP8 unnoticed."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    excluded = {id(module) for router in moe.routers(model) for module in router.modules()}
    linear = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    for entry in skip:
        if not any(names_layer(name, entry) for name in linear):
            raise ConfigError(f"--float8.filter_fqns {entry} names no linear layer of {model.config.model_type}; its "
                              f"linear layers are {', '.join(layer_kinds(model, list(linear)))}: name some of them (or "
                              "their last parts)")
    eligible = {}
    for name, module in linear.items():
        if module is head or id(module) in excluded or any(names_layer(name, entry) for entry in skip):
            continue
        if ".lora_A." in f".{name}." or ".lora_B." in f".{name}.":  # PEFT's adapters: plain Linears of rank width
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        eligible[name] = (module.in_features, module.out_features)
    return eligible


BLOCKS, LAYERS, EAGER = "blocks", "layers", "eager"  # what --training.compile compiles, as ``convert`` is told


def convert(model: nn.Module, settings: Float8Settings, tokens: int, compiled: str, fsdp: bool,
            backend: str = "inductor") -> str:
    """Swap the chosen linear layers of ``model`` (built, not yet sharded) for Float8Linear; returns the log line.

    ``tokens``: rows x tokens a micro-batch, the matmuls' first dimension (what ``layers auto`` times them at).
    ``compiled``: ``BLOCKS`` (the decoder blocks will be compiled), ``LAYERS`` (--training.compile, but the type's
    blocks stay eager: each converted layer is compiled on its own with ``backend``, ``compile_each``) or ``EAGER``.
    """
    check_device()
    float8 = _torchao_float8()
    eligible = eligible_layers(model, settings.skip)
    if settings.layers == "auto" and device.CUDA:
        # compiled blocks cast an input once for all its readers: grouped there, each layer alone otherwise
        grouped = input_groups(model, list(eligible)) if compiled == BLOCKS else [(name,) for name in eligible]
        groups = {group: tuple(eligible[name] for name in group) for group in grouped}
        faster = faster_in_fp8(sorted(set(groups.values())), tokens, settings.recipe, compiled != EAGER)
        chosen = {name for group, shapes in groups.items() if shapes in faster for name in group}
        timed = {BLOCKS: "those reading one input timed together", LAYERS: "each compiled alone", EAGER: "eager"}
        why = f"the layers FP8 ran faster at {tokens:,} tokens on this GPU ({timed[compiled]})"
    else:
        chosen = set(eligible)
        why = "every eligible layer" if device.CUDA else "every eligible layer (emulated on the CPU: numerics, not speed)"
    if not chosen:
        remedy = "; with --training.compile its casts fuse and FP8 can win" if compiled == EAGER else ""
        return f"FP8 ({settings.recipe}): no linear layer converted ({why}: none of {len(eligible)} eligible){remedy}"
    float8.convert_to_float8_training(model, config=torchao_config(settings, fsdp),
                                      module_filter_fn=lambda module, name: name in chosen)
    converted = [module for name, module in model.named_modules() if name in chosen]
    # fla's fused SwiGLU+Linear would read a converted down projection's weight itself, in bf16
    compat.fla.down_projections_called(model, set(map(id, converted)))
    if compiled == LAYERS:
        compile_each(converted, backend)
    gathered = " (weights all-gathered in FP8)" if settings.all_gather and fsdp else ""
    alone = "; the blocks stay eager, so each converted layer is compiled on its own" if compiled == LAYERS else ""
    return (f"FP8 ({settings.recipe}): {len(chosen)} of {len(eligible)} eligible linear layers{gathered}, {why}"
            f"{alone}; MFU counts their FLOPs at bf16's peak")


def compile_each(layers: list[nn.Module], backend: str) -> None:
    """Compile each of ``layers`` (converted) on its own. Eager, torchao scales and casts a layer's input, weight and output
    gradient in separate kernels, passes over memory that cost more than FP8's matmul saves (the 7B's 224 layers all
    lost at 131,072 rows, docs/perf-log.md 2026-12-07); compiled, they fuse into the kernels around the matmul.
    Layers of one shape share a compiled graph (dynamo guards on shapes, not on the module); all of them are frames of
    one function (``nn.Module._call_impl``), so dynamo's recompile limit (8 graphs a function, the rest left eager)
    is raised to a graph for each shape, with and without an input gradient."""
    shapes = {(layer.in_features, layer.out_features) for layer in layers}
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * len(shapes))
    for layer in layers:
        layer.compile(backend=backend, dynamic=False)


def torchao_config(settings: Float8Settings, fsdp: bool):
    config_class = _torchao_float8().Float8LinearConfig
    if settings.recipe == "tensorwise":
        config = config_class(enable_fsdp_float8_all_gather=settings.all_gather and fsdp)
    else:
        config = config_class.from_recipe_name(settings.recipe)
    return dataclasses.replace(config, emulate=not device.CUDA)


def precompute_scales(model_parts: list[nn.Module]) -> None:
    """After an optimizer step: every FP8-gathered weight's scale at once, read by FSDP's next all-gathers."""
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for model in model_parts:
        precompute(model)


def gathers_in_fp8(settings: Float8Settings | None, fsdp: bool) -> bool:
    """Whether the weights' scales are precomputed after each optimizer step (tensorwise under FSDP)."""
    return settings is not None and fsdp and settings.all_gather and settings.precompute


# ---- layers auto: each group of layers timed in bf16 and in FP8 on this GPU ---------------------------------------


def input_groups(model: nn.Module, names: list[str]) -> list[tuple[str, ...]]:
    """``names`` (linear layers of ``model``) grouped by the input they read: an attention's q, k and v projections
    read one tensor, a gated MLP's gate and up projections another. FP8 scales and casts an input once for all of
    its readers where the blocks are compiled (the compiler merges the identical casts), so such a group gains or
    loses together and is timed together. Found by a forward of ``model`` on the meta device (it is built there
    before parallelizing); where that forward cannot run (a model on real memory, fla's Triton kernels, data-dependent
    routing) each layer is its own group."""
    modules = dict(model.named_modules())
    singletons = [(name,) for name in names]
    if any(parameter.device.type != "meta" for parameter in model.parameters()):
        return singletons
    readers: dict[int, list[str]] = {}
    inputs: list[torch.Tensor] = []  # held for the forward's length: an id is unique only while its tensor lives

    def reads(name: str):
        def hook(module, args):
            inputs.append(args[0])
            readers.setdefault(id(args[0]), []).append(name)
        return hook

    handles = [modules[name].register_forward_pre_hook(reads(name)) for name in names]
    try:
        # flame's attention, norms and MLPs on meta tensors as their stand-ins (no kernel reads meta memory)
        with (torch.no_grad(), compat.triton.kernel_launches_refused(), attention.kept_as_flash_kernels("varlen"),
              fused.kept_as_on_cuda()):
            model(input_ids=torch.zeros(1, 16, dtype=torch.long, device="meta"))
    except Exception:  # noqa: BLE001 - any model whose forward needs real memory: per layer, as before
        return singletons
    finally:
        for handle in handles:
            handle.remove()
    grouped = {name for group in readers.values() for name in group}
    return [tuple(group) for group in readers.values()] + [(name,) for name in names if name not in grouped]


@dataclass
class GroupTimes:
    """Milliseconds of one forward and backward per group of layers reading one input:
    [[[[in, out], ...], bf16 ms, fp8 ms], ...]."""

    times: list[list]


Shapes = tuple[tuple[int, int], ...]  # a group's layers as (in_features, out_features)


def faster_in_fp8(groups: list[Shapes], tokens: int, recipe: str, compiled: bool) -> set[Shapes]:
    """The groups (layers reading one input, by shape) whose forward and backward at ``tokens`` rows FP8 runs
    faster than bf16 on this GPU (``compiled``: as torch.compile runs them)."""
    key = json.dumps([torch.cuda.get_device_name(), torch.__version__, _torchao_version(), recipe, compiled,
                      tokens, groups])
    path = cache_dir() / "float8" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    measured = measured_once(path, lambda p: GroupTimes(**json.loads(p.read_text())),
                             lambda: GroupTimes([[group, *_time_group(group, tokens, recipe, compiled)]
                                                 for group in groups]))
    return {tuple((int(k), int(n)) for k, n in group) for group, bf16, fp8 in measured.times if fp8 <= FASTER_BY * bf16}


class _Readers(nn.Module):
    """Linear layers that read one input, as a block calls them."""

    def __init__(self, shapes: Shapes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for k, n in shapes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer in self.layers)


def _time_group(shapes: Shapes, tokens: int, recipe: str, compiled: bool) -> tuple[float, float]:
    """(bf16 ms, FP8 ms): one forward and backward of the group at ``tokens`` rows, bf16 weights and input, as FSDP
    runs it; the median of 20 after a warm-up (which compiles)."""
    settings = Float8Settings(recipe=recipe, layers="all", skip=(), all_gather=False, precompute=False)
    times = tuple(_time_readers(shapes, tokens, compiled, settings if fp8 else None) for fp8 in (False, True))
    torch.cuda.empty_cache()
    return times


def _time_readers(shapes: Shapes, tokens: int, compiled: bool, fp8: Float8Settings | None) -> float:
    readers = _Readers(shapes)
    if fp8 is not None:
        _torchao_float8().convert_to_float8_training(readers, config=torchao_config(fp8, fsdp=False))
    if compiled:
        # each group is a new module for one code object: past dynamo's recompile limit (8) the rest would run
        # eager and be timed so. The probe runs before the model's blocks or layers are compiled: nothing to lose
        torch._dynamo.reset()
    run = torch.compile(readers, dynamic=False) if compiled else readers
    rows = torch.randn(tokens, shapes[0][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for _, n in shapes]
    return _median_ms(lambda: torch.autograd.backward(run(rows), grads))


def _median_ms(step, warmup: int = 3, repeats: int = 20) -> float:
    for _ in range(warmup):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[repeats // 2]
