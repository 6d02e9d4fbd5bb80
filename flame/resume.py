"""Preflight for a run that loads a checkpoint: the weights saved there must fit this job's model.

Without the check, a run pointed at a dump folder of another model (say the debug job's folder
with a different --model.config) started every process, overwrote the folder's job_config.json
(from which the folder's own checkpoints are exported), and only then failed inside DCP with
"Missing key in checkpoint state_dict".
"""

import os
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, PretrainedConfig

from flame.config_manager import ConfigError


def checkpoint_to_load(job_config) -> str | None:
    """The DCP checkpoint torchtitan's Checkpointer will load for this job, or None.

    Its rule: with <dump_folder>/<checkpoint.folder> present, step ``checkpoint.load_step`` or the
    latest step-N holding DCP metadata; otherwise ``checkpoint.initial_load_path``.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return None
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if not os.path.exists(folder):
        return checkpoint.initial_load_path or None
    if checkpoint.load_step != -1:
        return os.path.join(folder, f"step-{checkpoint.load_step}")
    steps = [
        int(match.group(1))
        for name in os.listdir(folder)
        if (match := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    return os.path.join(folder, f"step-{max(steps)}") if steps else None


def check_checkpoint_fits_model(job_config, model_config: PretrainedConfig) -> None:
    """ConfigError when the checkpoint this job would load lacks a weight of its model or has another shape."""
    path = checkpoint_to_load(job_config)
    if path is None or not os.path.isfile(os.path.join(path, ".metadata")):
        return  # nothing to load, or torchtitan's own error about the missing step
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    with torch.device("meta"):  # the weight names and shapes only; flame's builder changes neither
        model = AutoModelForCausalLM.from_config(model_config)
    problems = []
    for name, tensor in model.state_dict().items():
        size = getattr(saved.get(name), "size", None)  # None: absent, or saved as bytes
        if size is None:
            problems.append(f"it has no {name}")
        elif tuple(size) != tuple(tensor.shape):
            problems.append(f"{name} is {list(size)} there, {list(tensor.shape)} here")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"this run would load {path}, which does not fit --model.config {job_config.model.config}: "
            f"{problems[0]}{more}; give this model its own --job.dump_folder (or, to start from those weights, "
            "use the model config they were trained with)"
        )
