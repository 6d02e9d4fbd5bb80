"""The memory plan's GPU probe: a model's activations measured on the GPU, once per machine.

Models whose forward cannot run on meta tensors (fla's Triton kernels) are measured by
``flame.memory.activations``' hooks on the GPU instead (``probed``): the whole model materialized
there in the job's precision, its forward at three row lengths up to 4K tokens (one document a
row), the saved tensors counted, then the model freed. The precision matters: a job without FSDP
computes under autocast with float32 weights, so its residual stream, and every norm input saved
from it, is float32 (twice the bytes of the same model in bf16; gla 340M keeps 40% more).
Autocast does not reach meta tensors, so on a GPU such a job's HF model is probed too, and its
meta forward stays the answer only where the probe fails. A model too large to probe whole is
measured on its first blocks (``_first_blocks_probed``): one whose weights and a formula's
activations would fill more than ``WHOLE_SHARE`` of the free memory, or whose whole probe ran out
of it.

The probe also measures what a block's backward allocates beyond what the forward kept: the
gradients flowing through the block and its kernels' buffers (fla's chunked kernels build and
free state tensors there: gated_deltanet's measured peak stood well above its saved tensors,
docs/perf-log.md). The last block's backward runs at each row length, from its own output, with
the peak of allocated memory read around it. Only the input's gradient is asked for: the weights'
gradients do not grow with the row (the plan counts them itself), and they would set the short rows'
peaks. What grows between the two longest rows is the per-token slope the plan extrapolates.

The probe runs once per machine: the result is cached under ``$FLAME_CACHE/activations`` by model
config, precision, GPU and library versions (the job's check measures it, its ranks read it).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path

import torch
from transformers import PretrainedConfig

from flame import compat
from flame.base import device
from flame.data import builtin
from flame.memory.activations import (
    FALLBACK_TENSORS_PER_HIDDEN,
    ActivationProfile,
    Quadratic,
    as_trained,
    fitted_profile,
)
from flame.base.measured_once import measured_once
from flame.models.lora import LoraSettings
from flame.models.builder import reinitialize
from flame.models.registry import meta_model

# the probe's rows: long enough for kernels that work in chunks of 64, short enough that a 7B's
# forward (weights and what it saves) fits an 80 GB GPU
PROBE_LENGTHS = (1024, 2048, 4096)
PROBE_BLOCKS = 3  # blocks measured of a model too large to probe whole (_first_blocks_probed)
WHOLE_SHARE = 0.6  # of the GPU's free memory, what a whole model's probe may expect to take (_fits_whole)
# what a cached probe holds (an older cache is measured again): 2 added the backward's buffers; 3 measures again
# what fell back to the formula when a failed probe left its memory held and the first-blocks probe failed too; 4
# measures the backward's buffers without the weights' gradients, as a per-token slope
PROBE_VERSION = 4


def probe_device() -> torch.device | None:
    """Where a model is measured when the meta forward cannot run it, or not in the job's precision: this
    process's GPU, else nowhere."""
    if not (device.CUDA and torch.cuda.is_available()):
        return None
    # this rank's GPU: the ranks have not picked theirs yet, and memory on GPU 0 would crowd rank 0
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def probed(config: PretrainedConfig, dtype: torch.dtype, where: torch.device, autocast: bool, fused: bool,
           adapters: LoraSettings | None, otherwise: Callable[[str], ActivationProfile]) -> ActivationProfile:
    """``probe``'s profile, from the cache when this machine measured it before (under a lock: one process measures).

    A probe that fails (out of memory, a kernel that refuses this GPU) leaves ``otherwise(why)``
    (the meta forward's profile, or the formula), cached as well: every rank then plans from the
    same numbers, and none tries again.
    """
    def measure() -> ActivationProfile:
        try:
            if _fits_whole(config, dtype, where, autocast):
                try:
                    return probe(config, dtype, where, PROBE_LENGTHS, autocast, fused, adapters)
                except torch.OutOfMemoryError:
                    pass  # measured below on fewer blocks, outside this handler: its traceback holds the forward's tensors
            return _first_blocks_probed(config, dtype, where, autocast, fused, adapters)
        except Exception as error:  # noqa: BLE001
            return otherwise(f"the GPU probe failed: {type(error).__name__}: {error}")

    return measured_once(probe_cache_path(config, dtype, where, autocast, fused, adapters), _read, measure)


def _first_blocks_probed(config: PretrainedConfig, dtype: torch.dtype, where: torch.device, autocast: bool,
                         fused: bool, adapters: LoraSettings | None) -> ActivationProfile:
    """The probe of a model that does not fit the GPU whole (a 7B under autocast: float32 weights, their
    16-bit copies and 4K tokens' activations outgrow 80 GB): its first ``PROBE_BLOCKS`` blocks measured,
    the ones after the first repeated for the rest. The first block keeps the embeddings' output too; the
    next two stand for a stack of alike blocks, or of two kinds in turn (samba's)."""
    blocks = config.num_hidden_layers
    shorter = copy.deepcopy(config)
    shorter.num_hidden_layers = min(blocks, PROBE_BLOCKS)
    profile = probe(shorter, dtype, where, PROBE_LENGTHS, autocast, fused, adapters)
    measured = len(profile.blocks)
    take = [index if index < measured else 1 + (index - 1) % max(1, measured - 1) for index in range(blocks)]
    method = (f"{profile.method[:-1]}; the first {measured} of {blocks} blocks, the later ones repeated: the whole "
              "model did not fit the GPU)")
    return dataclasses.replace(profile, blocks=tuple(profile.blocks[i] for i in take),
                               selective=tuple(profile.selective[i] for i in take), method=method)


def _fits_whole(config: PretrainedConfig, dtype: torch.dtype, where: torch.device, autocast: bool) -> bool:
    """Whether the whole model's probe should fit the GPU's free memory with room to spare (``WHOLE_SHARE``): its
    weights (float32 and a 16-bit copy of each under autocast, else in ``dtype``) and, at the longest row, the
    formula's activations in float32. Past that the first blocks are measured at once, rather than after
    materializing a model that runs out of memory (a 7B under autocast on an 80 GB H100)."""
    params = sum(p.numel() for p in meta_model(config).parameters())
    weights = params * (6 if autocast else torch.tensor([], dtype=dtype).element_size())
    saved = config.num_hidden_layers * max(PROBE_LENGTHS) * FALLBACK_TENSORS_PER_HIDDEN * config.hidden_size * 4
    return weights + saved <= WHOLE_SHARE * _free_bytes(where)


def _free_bytes(where: torch.device) -> float:
    return torch.cuda.mem_get_info(where)[0] if where.type == "cuda" else math.inf


def probe(config: PretrainedConfig, dtype: torch.dtype, where: torch.device | str,
          lengths: tuple[int, int, int], autocast: bool = False, fused: bool = False,
          adapters: LoraSettings | None = None) -> ActivationProfile:
    """Measure on ``where`` (a GPU): the model materialized there, its forward at ``lengths`` tokens, then freed.

    ``autocast``: float32 weights, the forward under autocast to ``dtype`` (the job's AMP); else the
    weights in ``dtype``, as FSDP's mixed precision gathers them. Autocast's weight copies are kept
    for the backward too, but they do not grow with the row: the fit's per-token terms leave them out.
    """
    where = torch.device(where)
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):  # the job's RNG stream untouched
        model = meta_model(config)
        if not autocast:
            model = model.to(dtype)
        model.to_empty(device=where)
        reinitialize(model)
        as_trained(model, fused, adapters)
        precision = f"float32 weights under {dtype_name(dtype)} autocast" if autocast else f"{dtype_name(dtype)} weights"
        precision += ", flame's fused norms and MLPs" if fused else ""
        try:
            # memory, not speed, is measured: fla's kernels run their first configuration that compiles instead of
            # timing every one (the compiles were most of a new machine's probe: rwkv7 340M's passed 150 s)
            untimed = compat.triton.untimed_autotuning() if where.type == "cuda" else nullcontext()
            with untimed, torch.autocast(where.type, dtype) if autocast else nullcontext():
                backward = ", the last block's backward" if where.type == "cuda" else ""  # memory read on CUDA only
                return fitted_profile(model, lengths, where, f"on the {_device_name(where)}, {precision}: forward at "
                                f"{', '.join(map(str, lengths))} tokens, saved tensors{backward}")
        finally:
            del model
            if where.type == "cuda":
                torch.cuda.empty_cache()


def probe_cache_path(config: PretrainedConfig, dtype: torch.dtype, where: torch.device, autocast: bool,
                     fused: bool = False, adapters: LoraSettings | None = None) -> Path:
    """The cached probe of ``config`` in this precision on this kind of GPU, with these kernel libraries."""
    versions = []
    for package in ("torch", "triton", "flash-linear-attention", "fla-core", "transformers"):
        try:
            versions.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    key = json.dumps([config.to_json_string(use_diff=False), str(dtype), autocast, fused, _device_name(where), versions,
                      PROBE_LENGTHS, PROBE_VERSION] + ([dataclasses.asdict(adapters)] if adapters is not None else []))
    return builtin.cache_dir() / "activations" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device_name(where: torch.device) -> str:
    return torch.cuda.get_device_name(where) if where.type == "cuda" else str(where)


def _read(path: Path) -> ActivationProfile:
    data = json.loads(path.read_text())
    return ActivationProfile(
        blocks=tuple(Quadratic(**b) for b in data["blocks"]),
        selective=tuple(Quadratic(**b) for b in data["selective"]),
        block_input=float(data["block_input"]), rest=Quadratic(**data["rest"]),
        method=data["method"], backward=Quadratic(**data["backward"]),
    )
