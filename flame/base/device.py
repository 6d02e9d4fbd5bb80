"""The one place that knows how flame runs on CPU (gloo) versus CUDA (NCCL).

torchtitan assumes an accelerator: without one it still picks "cuda" and ``torch.cuda`` as
its device type/module, so process groups, meshes and memory monitors would fail on a CPU
machine. Where ``CUDA`` is False, flame.compat.torchtitan points torchtitan's device at the CPU
(``CpuDeviceModule`` answers the ``torch.cuda`` calls torchtitan makes) and turns its autocast
off. Every other CPU difference — fp32 compute, memory read from the process, replicated weight
init — is answered by a function here, so the rest of flame never branches on the device itself.
"""

import os
import resource
import sys
from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import utils as torchtitan_utils

from flame.base.errors import ConfigError

CUDA = torch.cuda.is_available()
TYPE = "cuda" if CUDA else "cpu"  # the device type of meshes and process groups
# NCCL can scale inside a reduce-scatter (PREMUL_SUM); gloo only sums.
COLLECTIVES_SCALE_IN_REDUCTION = CUDA


class CpuDeviceModule:
    """The part of the ``torch.cuda`` API torchtitan calls, answered for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass  # the process's peak RSS cannot be reset; memory reads as peak so far

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({torch.get_num_threads()} threads)"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


def check_supported(job_config) -> None:
    """Options that need CUDA, refused up front on a CPU machine."""
    if CUDA:
        return
    if job_config.profiling.enable_memory_snapshot:
        raise ConfigError("--profiling.enable_memory_snapshot records CUDA memory; it needs a GPU")
    if job_config.profiling.enable_profiling:
        raise ConfigError(
            "--profiling.enable_profiling needs a GPU (torchtitan 0.2.2's profiler asks for a GPU activity); "
            "profile CPU runs with py-spy instead"
        )
    if job_config.parallelism.enable_async_tensor_parallel:
        raise ConfigError("--parallelism.enable_async_tensor_parallel needs CUDA (inductor's symmetric-memory kernels); leave it off on CPU")
    if job_config.model.attention in ("varlen", "flex"):
        raise ConfigError(f"--model.attention {job_config.model.attention} runs CUDA kernels; on a CPU machine use sdpa (or auto)")


def fused_cross_entropy_enabled(job_config, vocab_size: int) -> bool:
    """--training.fused_cross_entropy resolved: auto = on for CUDA runs with a large vocabulary."""
    choice = job_config.training.fused_cross_entropy
    return choice == "on" or (choice == "auto" and CUDA and vocab_size >= 16384)


def compute_dtype(job_config) -> torch.dtype:
    """Parameter/activation dtype for the forward pass: bf16 (or as configured) on GPU, fp32 on CPU."""
    if not CUDA:
        return torch.float32
    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def peak_flops() -> float | None:
    """bf16 dense peak FLOP/s of this device for MFU, or None on CPU (MFU is not reported)."""
    if not CUDA:
        return None
    return torchtitan_utils.get_peak_flops(torch.cuda.get_device_name())


def sharded_init_differs_from_full_init(model: torch.nn.Module) -> bool:
    """True when flame initializes a full copy of the model and shards it: CPU runs with DTensor params.

    On CPU, DTensor has no RNG tracker, so every rank would draw the same values for its own
    shard; the full copy makes every CPU layout start from one process's weights (the parity
    tests rely on it). On CUDA, DTensor's offset-based RNG draws distinct, equally distributed
    values per shard, without a full copy's memory; but they are not the values one GPU draws,
    so GPU layouts start from different weights unless they load one seed checkpoint
    (--checkpoint.create_seed_checkpoint, docs/checkpoints.md).
    """
    if CUDA:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def evaluation_process() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of a flame.eval process: under torchrun, in a process group of its
    own (NCCL on CUDA, gloo on CPU) on its local GPU; alone, on the first GPU, else the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if CUDA else torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        if CUDA:
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if CUDA else "gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world, device
