"""DCP checkpoints on disk: which one a run loads, whether it is intact, and whether a model's weights fit it.

Used by train.sh's preflight (flame.launch.preflight), by every rank before it loads
(flame.checkpoint.manager) and by the HF export (flame.checkpoint.export).

A step loads only once its files match its manifest (flame.checkpoint.manifest): before that, nothing of it
is read, DCP's ``.metadata`` (a pickle) included. A damaged or incomplete latest step is set
aside as ``step-N.damaged`` / ``step-N.incomplete`` (so that the run, reaching step N again,
does not write over it) and the newest intact step loads; a step named explicitly stops the
run in one line instead. The fit check exists because a run pointed at the dump folder of
another model started every process, overwrote the folder's job_config.json (from which its
checkpoints are exported), and only then failed inside DCP with "Missing key in checkpoint
state_dict".
"""

import os
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from flame.checkpoint import manifest
from flame.base.errors import ConfigError
from flame.checkpoint.manifest import Defect, complete_steps
from flame.models import lora

EMA_STATE = "ema"  # the checkpoint's entry of the weights' average (flame.training.ema): ema.<name> in DCP's files


def newest_intact(steps: dict[int, str], defect: Callable[[str], Defect | None], warn: Callable[[str], None] | None) -> str | None:
    """The newest of ``steps`` (step -> folder) that ``defect`` finds intact, or None.

    With ``warn`` (in one process of the job), every newer step is set aside and ``warn`` gets one
    line for each: the step, the file and what is wrong with it, where it went, what loads instead.
    """
    chosen, moved = None, []
    for step in sorted(steps, reverse=True):
        found = defect(steps[step])
        if found is None:
            chosen = steps[step]
            break
        if warn is not None:
            moved.append((steps[step], found, manifest.set_aside(steps[step], found.kind)))
    then = f"this run loads {chosen}" if chosen else "no intact step is left, so this run starts from step 1"
    for path, found, target in moved:
        # a step with DCP's metadata but no manifest may have been written by another program
        trusted = (f"; to load it if you trust who wrote it, rename it back and run python -m flame.checkpoint.manifest {path}"
                   if manifest.unrecorded(target) else "")
        warn(f"checkpoint {path} is {found.kind}: {found.problem}; moved it to {target} (nothing is deleted), and {then}{trusted}")
    return chosen


def explicit_step_error(folder: str, step: int, found: Defect | None) -> str:
    """The one-line error for ``--checkpoint.load_step`` naming a step that is not there (``found`` None) or cannot load."""
    steps = complete_steps(folder)
    what = f"{os.path.join(folder, f'step-{step}')} is {found.kind}: {found.problem}" if found else f"{folder} has no complete step-{step}"
    if steps:
        fix = f"its complete steps are {', '.join(map(str, steps))}: name one, or drop --checkpoint.load_step to resume from the latest intact one"
    else:
        fix = "it holds no complete checkpoint: drop --checkpoint.load_step to start from step 1"
    return f"--checkpoint.load_step {step}: {what}; {fix}"


def unrecorded_checkpoint_error(flag: str, path: str, found: Defect) -> str:
    """The one-line error for a checkpoint from elsewhere (``flag`` names it) that fails its check."""
    if manifest.unrecorded(path):
        return (
            f"{flag} {path} has no {manifest.MANIFEST}, so nothing shows its files are the ones written; its "
            f"{manifest.METADATA} is a pickle, and loading it runs whatever its author put there. If you trust who wrote "
            f"it, record its manifest: python -m flame.checkpoint.manifest {path}"
        )
    return f"{flag} {path} is {found.kind}: {found.problem}"


def _warn(message: str) -> None:
    print(f"flame: warning: {message}", file=sys.stderr)


def _refuse_checkpoints_elsewhere(dump_folder: str, folder: str) -> None:
    """ConfigError when another folder of the dump folder than ``folder`` holds complete steps: torchtitan would start
    this run at step 1 beside them (a second step 1 in metrics.jsonl) instead of resuming them."""
    if not os.path.isdir(dump_folder):
        return
    mine = os.path.normpath(os.path.join(dump_folder, folder))
    for name in sorted(os.listdir(dump_folder)):
        other = os.path.join(dump_folder, name)
        if os.path.normpath(other) != mine and (steps := complete_steps(other)):
            raise ConfigError(
                f"--checkpoint.folder {folder} holds no checkpoint, but {other} of this dump folder holds steps "
                f"{', '.join(map(str, steps))}: to resume them give --checkpoint.folder {name}; to start a new run, "
                "give it its own --job.dump_folder"
            )


def check_checkpoint(job_config) -> str | None:
    """The checkpoint this job will load, checked against its manifest (None: it loads none).

    torchtitan's rule: with <dump_folder>/<checkpoint.folder> present, step
    ``checkpoint.load_step`` or the latest step; otherwise ``checkpoint.initial_load_path``.
    ConfigError when one given explicitly is not there or fails its check (torchtitan would
    train from step 1 when ``--checkpoint.load_step`` names a step of an empty folder, fail
    inside a rank when the folder has other steps, and fail late on a missing
    ``--checkpoint.initial_load_path``); a latest step that fails it is set aside. ConfigError too when
    ``checkpoint.folder`` holds no complete step but another folder of the dump folder does.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        for flag, given in (("load_step", checkpoint.load_step != -1), ("initial_load_path", checkpoint.initial_load_path)):
            if given:  # torchtitan loads nothing with checkpointing off
                raise ConfigError(f"--checkpoint.{flag} loads a checkpoint, but checkpointing is off: add --checkpoint.enable")
        return None
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if checkpoint.load_step != -1:
        path = os.path.join(folder, f"step-{checkpoint.load_step}")
        found = manifest.defect(path) if os.path.isdir(path) else None
        if found or not os.path.isdir(path):
            raise ConfigError(explicit_step_error(folder, checkpoint.load_step, found))
        return path
    if not checkpoint.initial_load_path and not complete_steps(folder):
        _refuse_checkpoints_elsewhere(job_config.job.dump_folder, checkpoint.folder)
    if not os.path.exists(folder):
        path = checkpoint.initial_load_path
        if not path:
            return None
        if not os.path.isfile(os.path.join(path, manifest.METADATA)):
            raise ConfigError(
                f"--checkpoint.initial_load_path {path} is not a complete DCP checkpoint "
                "(no .metadata there); give a step folder such as <dump_folder>/checkpoint/step-1000"
            )
        if found := manifest.defect(path):
            raise ConfigError(unrecorded_checkpoint_error("--checkpoint.initial_load_path", path, found))
        return path
    return newest_intact(manifest.step_folders(folder), manifest.defect, _warn)


def model_only(job_config, path: str) -> bool:
    """Whether loading ``path`` takes its weights alone (step 0, or --checkpoint.initial_load_path model-only): a new
    run starts from them."""
    checkpoint = job_config.checkpoint
    return os.path.basename(path) == "step-0" or (path == checkpoint.initial_load_path and checkpoint.initial_load_model_only)


def weight_mismatches(metadata: Metadata, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """What keeps DCP from loading ``state_dict`` from a checkpoint: absent weights, other shapes."""
    problems = []
    for name, tensor in state_dict.items():
        size = getattr(metadata.state_dict_metadata.get(name), "size", None)  # None: absent, or saved as bytes
        if size is None:
            problems.append(f"it has no {name}")
        elif tuple(size) != tuple(tensor.shape):
            problems.append(f"{name} is {list(size)} there, {list(tensor.shape)} here")
    return problems


def check_checkpoint_fits_model(job_config, meta: Callable[[], nn.Module], path: str | None) -> None:
    """ConfigError when ``path``, the checkpoint check_checkpoint verified for this job, lacks a weight of its
    model or has another shape (it unpickles DCP's .metadata: call it only on a verified step).

    ``meta``: gives the job's model on the meta device, which this check may add LoRA's adapters to.
    """
    if path is None:
        return
    model = meta()
    if (adapters := lora.LoraSettings.of(job_config.lora)) is not None and not model_only(job_config, path):
        lora.add_adapters(model, adapters)  # a resume reads the adapters too (a model-only load: the base alone)
    problems = weight_mismatches(FileSystemReader(path).read_metadata(), lora.checkpoint_weights(model))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"this run would load {path}, which does not fit --model.config {job_config.model.config}: "
            f"{problems[0]}{more}; give this model its own --job.dump_folder (or, to start from those weights, "
            "use the model config they were trained with)"
        )
