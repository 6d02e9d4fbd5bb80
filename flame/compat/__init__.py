"""flame's changes to other libraries: one seam per library, each change named, guarded, applied explicitly.

    torchtitan.py    CPU runs without an accelerator; checkpoint manifests; no sleep after training; the private
                     names flame uses
    transformers.py  flame's document attention in transformers' attention registry; fused rotary embeddings
    fla.py           flash-attn stand-ins, autotune keys, dtype and compile fixes, CP and TP hooks
    fla_mamba.py     fla's Mamba layer (mamba, samba) with flame's selective scan: fast, documents kept apart
    fla_mamba2.py    fla's Mamba2 layer on fla's Triton conv and scan, packed documents kept apart
    mamba_ssm.py     mamba3's kernels from a mamba_ssm built without CUDA, under checkpointing
    triton.py        autotuning that waits for its own stream (pipeline parallelism); forwards that launch no kernel
    guard.py         how a change is declared, checked against the installed library, applied once

Each change is a function (a ``guard.Patch``) whose docstring says what upstream does, what
flame changes and why; its module names the version it was written for. Importing flame
changes nothing; the changes apply where flame calls them:
- ``apply(job_config)``: at the start of every process that trains (the Trainer); flame.launch
  runs its guard alone (``check``), so that a changed torchtitan is refused before torchrun starts;
- ``apply_after_fla_import``: once, by flame.models.registry.import_fla, the one place flame
  imports fla (lazily: it costs seconds);
- the transformers registration, when flame first resolves a model type
  (flame.models.registry.ensure_model_type): every path that builds a model passes there;
  ``flame.register()`` (loading exports) applies it and fla's changes up front;
- ``fla.kernels_take_cp_context``/``fla.gsa_norm_gathers_heads``: by context and tensor
  parallelism, for the fla models they run;
- ``transformers.fused_rotary(module)``: by flame.models.fused, once per modeling module of an HF
  model flame builds with fused kernels (--model.fused_kernels).
``describe()`` is the startup log's line of the changes applied. The guard refuses to start when
a change's target is missing or changed, and only warns about another version (guard.py says why).
Each seam is imported when first used (``compat.fla``, ``from flame.compat import fla``): importing
its library costs seconds (transformers' model code pulls in torch's compiler), and a process
needs few of them: flame.launch the torchtitan seam only, loading an export (``flame.register``)
fla's and transformers' seams.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

from flame.compat.guard import Patch, applied

if TYPE_CHECKING:
    from torchtitan.config import JobConfig

    from flame.compat import fla

__all__ = [
    "apply", "apply_after_fla_import", "check", "describe", "fla", "fla_mamba", "fla_mamba2", "mamba_ssm", "torchtitan",
    "transformers", "triton",
]


_SEAMS = ("fla", "fla_mamba", "fla_mamba2", "mamba_ssm", "torchtitan", "transformers", "triton")


def __getattr__(name: str):
    if name in _SEAMS:
        return importlib.import_module(f"flame.compat.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _startup_patches(job_config: "JobConfig") -> list[Patch]:
    from flame import device
    from flame.compat import torchtitan, triton

    patches = [torchtitan.checkpoints_with_manifests, torchtitan.ends_without_sleep]
    if not device.CUDA:
        patches.append(torchtitan.cpu_without_accelerator)
    elif job_config.parallelism.pipeline_parallel_degree > 1:
        patches.append(triton.autotune_on_the_current_stream)
    return patches


def check(job_config: "JobConfig") -> None:
    """Refuse (ConfigError) a torchtitan or triton that the changes this job needs at startup do not fit."""
    from flame.compat import torchtitan

    torchtitan.check_private_names()
    for patch in _startup_patches(job_config):
        patch.check()


def apply(job_config: "JobConfig") -> None:
    """Check, then apply the changes this job's processes need at startup (each once)."""
    from flame.compat import torchtitan

    torchtitan.check_private_names()
    for patch in _startup_patches(job_config):
        patch()


def apply_after_fla_import(flash_attn: "fla.FlashAttn") -> None:
    """fla's changes, flame's Mamba scan, and mamba_ssm's where it is installed (by flame.models.registry.import_fla only)."""
    from flame.compat import fla, fla_mamba, fla_mamba2, mamba_ssm

    fla.apply(flash_attn)
    fla_mamba.mamba_scans_documents()
    fla_mamba2.mamba2_keeps_documents_apart()
    if importlib.util.find_spec("mamba_ssm") is not None:  # without it preflight refuses mamba3
        mamba_ssm.apply()


def describe() -> str:
    """One line: the changes to other libraries applied in this process."""
    return f"Changes to other libraries (flame.compat): {', '.join(applied()) or 'none'}"
