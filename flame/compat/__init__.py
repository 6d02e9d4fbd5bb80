"""flame's changes to other libraries: one seam per library, each change named, guarded, applied explicitly.

    torchtitan.py    CPU runs without an accelerator (CPU offload included); checkpoint manifests; no sleep after
                     training; traces that cannot be written warn; the private names flame uses
    transformers.py  flame's document attention in transformers' attention registry; fused rotary embeddings;
                     hybrids' sequence kernels: PyTorch code on CPU tensors, packed documents kept apart
    fla.py           flash-attn stand-ins, autotune keys, dtype and compile fixes, chunk counts read on the host,
                     CP and TP hooks; gated MLPs that call a replaced down projection (LoRA, FP8)
    fla_mamba.py     fla's Mamba and Mamba2 layers on flame's kernels: fast, packed documents kept apart
    mamba_ssm.py     mamba3's kernels from a mamba_ssm built without CUDA, under checkpointing
    torchrun.py      train.sh's launcher: a first stop signal lets the ranks save, a second kills them; every
                     rank that had ended with an error is reported (a killed rank is named, not its peers)
    peft.py          a LoRA adapter's product added inside its matmul
    triton.py        autotuning that waits for its own stream (pipeline parallelism) and compiles a new shape's
                     configurations side by side; forwards that launch no kernel
    guard.py         how a change is declared, checked against the installed library, applied once

Each change is a function (a ``guard.Patch``) whose docstring says what upstream does, what
flame changes and why; its module names the version it was written for. Importing flame
changes nothing; the changes apply where flame calls them:
- ``apply(job_config, checkpoint_manager)``: at the start of every process that trains (the Trainer); flame.launch.preflight
  runs its guard alone (``check``), so that a changed torchtitan is refused before torchrun starts;
- ``apply_after_fla_import``: once, by flame.models.registry.import_fla, the one place flame
  imports fla (lazily: it costs seconds);
- the transformers registration, when flame first resolves a model type
  (flame.models.registry.ensure_model_type): every path that builds a model passes there;
  ``flame.register()`` (loading exports) applies it and fla's changes up front;
- ``fla.kernels_take_cp_context``/``fla.gsa_norm_gathers_heads``: by context and tensor
  parallelism, for the fla models they run;
- ``peft.adapter_added_in_its_matmul``: by flame.models.lora, when it adds adapters;
- ``transformers.fused_rotary(module)``: by flame.models.kernels.fused, once per modeling module of an HF
  model flame builds with fused kernels (--model.fused_kernels);
- ``transformers.reference_kernels_on_cpu(module, names)``, and on GPUs ``transformers.kernels_take_documents``:
  by flame.models.hybrid, once per modeling module of a transformers hybrid flame builds.
``describe()`` is the startup log's line of the changes applied. The guard refuses to start when
a change's target is missing or changed, and only warns about another version (guard.py says why).
Each seam is imported when first used (``compat.fla``, ``from flame.compat import fla``): importing
its library costs seconds (transformers' model code pulls in torch's compiler), and a process
needs few of them: flame.launch.preflight the torchtitan seam only, loading an export (``flame.register``)
fla's and transformers' seams.
"""

import importlib
import importlib.util
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from flame.compat.guard import Patch, applied

if TYPE_CHECKING:
    from torchtitan.config import JobConfig

    from flame.compat import fla

__all__ = [
    "apply", "apply_after_fla_import", "check", "describe", "fla", "fla_mamba", "mamba_ssm", "peft", "torchrun",
    "torchtitan", "transformers", "triton",
]


_SEAMS = ("fla", "fla_mamba", "mamba_ssm", "peft", "torchrun", "torchtitan", "transformers", "triton")


def __getattr__(name: str):
    if name in _SEAMS:
        return importlib.import_module(f"flame.compat.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _startup_patches(job_config: "JobConfig", checkpoint_manager: type | None = None) -> list[tuple[Patch, tuple]]:
    """The changes a training process needs at startup, each with the arguments it is applied with."""
    from flame.base import device  # it imports torchtitan, which loading an export (flame.register) does not need
    from flame.compat import torchtitan, triton

    patches = [(torchtitan.checkpoints_with_manifests, (checkpoint_manager,)), (torchtitan.ends_without_sleep, ()),
               (torchtitan.readable_log, (_model_label(job_config), not device.CUDA, job_config.job.print_config))]
    if job_config.profiling.enable_profiling or job_config.profiling.enable_memory_snapshot:
        patches.append((torchtitan.traces_never_stop_training, ()))
    if not device.CUDA:
        patches.append((torchtitan.cpu_without_accelerator, ()))
    elif job_config.parallelism.pipeline_parallel_degree > 1:
        patches.append((triton.autotune_on_the_current_stream, ()))
    return patches


def _model_label(job_config: "JobConfig") -> str:
    """How the log names the model: its type and where its config comes from ("llama (configs/llama_4M.json)")."""
    source = job_config.model.config or job_config.model.init_from or "model"
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    try:
        with open(path) as file:
            fields = json.load(file)
    except (OSError, ValueError):  # a hub name: transformers reads it, not this label
        return source
    return f"{fields.get('model_type', 'model')} ({source})" if isinstance(fields, dict) else source


def check(job_config: "JobConfig") -> None:
    """Refuse (ConfigError) a torchtitan or triton that the changes this job needs at startup do not fit."""
    from flame.compat import torchtitan

    torchtitan.check_private_names()
    for patch, _ in _startup_patches(job_config):
        patch.check()


def apply(job_config: "JobConfig", checkpoint_manager: type) -> None:
    """Check, then apply the changes this job's processes need at startup (each once); ``checkpoint_manager``:
    the class torchtitan's Trainer builds instead of its own (flame.checkpoint.manager.FlameCheckpointManager)."""
    from flame.compat import torchtitan

    torchtitan.check_private_names()
    for patch, args in _startup_patches(job_config, checkpoint_manager):
        patch(*args)


def apply_after_fla_import(flash_attn: "fla.FlashAttn", mamba_mix: Callable, mamba2_forward: Callable) -> None:
    """fla's changes, flame's Mamba computations, and mamba_ssm's where it is installed (by flame.models.registry.import_fla
    only, which hands in flame's attention and Mamba kernels: flame.compat imports nothing of flame.models)."""
    from flame.compat import fla, fla_mamba, mamba_ssm

    fla.apply(flash_attn)
    fla_mamba.mamba_scans_documents(mamba_mix)
    fla_mamba.mamba2_keeps_documents_apart(mamba2_forward)
    if importlib.util.find_spec("mamba_ssm") is not None:  # without it preflight refuses mamba3
        mamba_ssm.apply()


def describe() -> str:
    """One line: the changes to other libraries applied in this process."""
    return f"Changes to other libraries (flame.compat): {', '.join(applied()) or 'none'}"
