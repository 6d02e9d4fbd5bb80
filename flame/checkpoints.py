"""DCP checkpoints on disk: which one a run loads, and whether a model's weights fit it.

Used by train.sh's preflight (flame.launch) and by the HF export (flame.utils.convert_dcp_to_hf).
The preflight check exists because a run pointed at a dump folder of another model (say the
debug job's folder with a different --model.config) started every process, overwrote the
folder's job_config.json (from which the folder's own checkpoints are exported), and only then
failed inside DCP with "Missing key in checkpoint state_dict".
"""

import os
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from transformers import PretrainedConfig

from flame.errors import ConfigError
from flame.models.registry import meta_model


def complete_steps(checkpoint_folder: str) -> list[int]:
    """Steps whose checkpoint finished writing (DCP writes .metadata last, atomically)."""
    if not os.path.isdir(checkpoint_folder):
        return []
    steps = []
    for name in os.listdir(checkpoint_folder):
        match = re.fullmatch(r"step-(\d+)", name)
        if match and os.path.isfile(os.path.join(checkpoint_folder, name, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_to_load(job_config) -> str | None:
    """The DCP checkpoint torchtitan's Checkpointer will load for this job, or None.

    Its rule: with <dump_folder>/<checkpoint.folder> present, step ``checkpoint.load_step`` or the
    latest complete step; otherwise ``checkpoint.initial_load_path``.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return None
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if not os.path.exists(folder):
        return checkpoint.initial_load_path or None
    if checkpoint.load_step != -1:
        return os.path.join(folder, f"step-{checkpoint.load_step}")
    steps = complete_steps(folder)
    return os.path.join(folder, f"step-{steps[-1]}") if steps else None


def check_checkpoint_exists(job_config) -> None:
    """ConfigError when the job names a checkpoint to load that is not there, complete.

    torchtitan would train from step 1 when ``--checkpoint.load_step`` names a step of an empty
    folder, fail inside a rank when the folder has other steps, and fail late on a missing
    ``--checkpoint.initial_load_path``.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        for flag, given in (("load_step", checkpoint.load_step != -1), ("initial_load_path", checkpoint.initial_load_path)):
            if given:  # torchtitan loads nothing with checkpointing off
                raise ConfigError(f"--checkpoint.{flag} loads a checkpoint, but checkpointing is off: add --checkpoint.enable")
        return
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    steps = complete_steps(folder)
    if checkpoint.load_step != -1 and checkpoint.load_step not in steps:
        if steps:
            fix = f"its complete steps are {', '.join(map(str, steps))}: name one, or drop --checkpoint.load_step to resume from the latest"
        else:
            fix = "it holds no complete checkpoint: drop --checkpoint.load_step to start from step 1"
        raise ConfigError(
            f"--checkpoint.load_step {checkpoint.load_step}: {folder} has no complete step-{checkpoint.load_step}; {fix}"
        )
    if not os.path.exists(folder) and checkpoint.initial_load_path:
        if not os.path.isfile(os.path.join(checkpoint.initial_load_path, ".metadata")):
            raise ConfigError(
                f"--checkpoint.initial_load_path {checkpoint.initial_load_path} is not a complete DCP checkpoint "
                "(no .metadata there); give a step folder such as <dump_folder>/checkpoint/step-1000"
            )


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


def check_checkpoint_fits_model(job_config, model_config: PretrainedConfig) -> None:
    """ConfigError when the checkpoint this job would load lacks a weight of its model or has another shape."""
    path = checkpoint_to_load(job_config)
    if path is None or not os.path.isfile(os.path.join(path, ".metadata")):
        return  # nothing to load, or torchtitan's own error about the missing step
    problems = weight_mismatches(FileSystemReader(path).read_metadata(), meta_model(model_config).state_dict())
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"this run would load {path}, which does not fit --model.config {job_config.model.config}: "
            f"{problems[0]}{more}; give this model its own --job.dump_folder (or, to start from those weights, "
            "use the model config they were trained with)"
        )
