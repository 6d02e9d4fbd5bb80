"""--model.init_from: start a run from a Hugging Face model's weights, in one command.

    --model.init_from <HF model folder, or a hub name in the local HF cache>

- Where: the folder is found once, offline, while the job config is parsed (``resolve``; a hub
  name is looked up in the local cache only, nothing is downloaded), and --model.config and
  --model.tokenizer_path default to it (``default_model_files``).
- Fit: before any process group or weight exists, the weights' names and shapes (read from the
  safetensors headers: no tensor is read) are compared with the model the config builds
  (``check_fits``): missing, unexpected or differently shaped weights, or a folder holding
  another model_type, are one-line errors.
- Load: the run's model is built as usual (meta device, parallelized, materialized, initialized,
  non-persistent buffers such as rotary frequencies included), then its weights are read from
  the safetensors files straight into each rank's shards (``load``), model only: optimizer,
  schedule and data start fresh. flame.checkpoint.manager does this where torchtitan would
  load a checkpoint, and only when the dump folder has none: a resumed run reads its own.

Why torch's ``HuggingFaceStorageReader`` with ``dcp.load``: the state dict of the parallelized
model holds each rank's shards as DTensors (FSDP, HSDP, TP, CP) or plain tensors (one process,
DDP, a pipeline stage's part); DCP's planner maps every shard to the slice of the stored tensor
it covers, and the reader reads just that slice from the file (``safe_open(...).get_slice``) and
copies it in, converting the dtype (bf16 files into an fp32 model). No rank holds the whole
model, every layout loads alike, and sharded and unsharded safetensors folders read the same.
"""

import json
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from flame.data.tokenizer import TOKENIZER_FILES
from flame.base import hub
from flame.base.errors import ConfigError, gist

FLAG = "--model.init_from"
SAFETENSORS = ".safetensors"


def resolve(location: str) -> str:
    """The local folder ``location`` names: itself, or a hub name's snapshot in the local HF cache (offline)."""
    if os.path.exists(location):
        folder = location
    elif hub.is_hub_name(location):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = snapshot_download(location, local_files_only=True)
        except (LocalEntryNotFoundError, ValueError, OSError):
            raise ConfigError(
                f"{FLAG} {location} is neither a folder nor a hub name in the local HF cache (flame downloads "
                f"nothing); download it first (hf download {location}) or give the model's folder"
            ) from None
    else:
        raise ConfigError(f"{FLAG} {location} does not exist; give a Hugging Face model folder (config.json + *.safetensors)")
    if not os.path.isdir(folder):
        raise ConfigError(f"{FLAG} {location} is a file; give the Hugging Face model's folder (config.json + *.safetensors)")
    if os.path.isfile(os.path.join(folder, "adapter_config.json")) and not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(
            f"{FLAG} {location} holds a LoRA adapter, not a whole model; give its base model, or export the run merged "
            "(python -m flame.utils.convert_dcp_to_hf --lora_export merged)"
        )
    if not _weight_files(folder):
        bin_only = any(name.endswith(".bin") for name in os.listdir(folder))
        if bin_only:
            fix = "it holds PyTorch .bin weights only: load it with transformers and save_pretrained it, which writes safetensors"
        elif folder != location:  # a hub name whose weights the cache lacks
            fix = f"download them first (hf download {location})"
        else:
            fix = "give a folder that save_pretrained wrote (config.json + *.safetensors)"
        raise ConfigError(f"{FLAG} {location} holds no {SAFETENSORS} weights; {fix}")
    return folder


def check_other_starts(checkpoint) -> None:
    """ConfigError for the --checkpoint settings that would give the run other starting weights."""
    for given, flag in ((checkpoint.initial_load_path, "--checkpoint.initial_load_path"),
                        (checkpoint.create_seed_checkpoint, "--checkpoint.create_seed_checkpoint")):
        if given:
            raise ConfigError(f"{FLAG} and {flag} both give the run its starting weights: drop one of them")


def default_model_files(model, given: dict[str, int]) -> None:
    """model.config and model.tokenizer_path from the init_from folder, unless given where init_from is or later.

    ``given``: where each setting came from (flame.config.merge: TOML < CLI). A job TOML's model
    config and tokenizer describe its template's model, so ``--model.init_from`` on the command
    line replaces them; a ``--model.config`` on the command line stays (and must fit the weights).
    """
    level = given.get("model.init_from", 0)
    if given.get("model.config", 0) < level or not model.config:
        model.config = model.init_from
    holds_tokenizer = any(os.path.isfile(os.path.join(model.init_from, name)) for name in TOKENIZER_FILES)
    if holds_tokenizer and (given.get("model.tokenizer_path", 0) < level or model.tokenizer_path is None):
        model.tokenizer_path = model.init_from


def _weight_files(folder: str) -> list[str]:
    # the files HuggingFaceStorageReader reads: every .safetensors file of the folder
    return sorted(name for name in os.listdir(folder) if name.endswith(SAFETENSORS))


def stored_shapes(folder: str) -> dict[str, list[int]]:
    """Every weight in the folder's safetensors files and its shape (from the headers only)."""
    try:
        metadata = HuggingFaceStorageReader(folder).read_metadata()
    except Exception as error:  # safetensors' own errors, a file cut short among them
        raise ConfigError(f"{FLAG} {folder}: cannot read its safetensors files ({gist(error)}); save the model again") from None
    return {name: list(item.size) for name, item in metadata.state_dict_metadata.items()}


def model_type(folder: str) -> str | None:
    """The model_type of the folder's config.json (None without one)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigError(f"{FLAG} {folder}: cannot read its config.json ({gist(error)}); fix it or save the model again") from None


def _tied_names(model: nn.Module) -> dict[str, set[str]]:
    """Each weight name -> the other names of the same tensor (tied embeddings: lm_head.weight and the input's)."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return {name: group - {name} for group in names.values() for name in group}


def _ignored(patterns: list[str] | None, name: str) -> bool:
    return any(re.search(pattern, name) for pattern in patterns or ())


def mismatches(model: nn.Module, stored: dict[str, list[int]]) -> list[str]:
    """What keeps ``stored`` (name -> shape) from being ``model``'s weights, in the model's order, one phrase each.

    A tied weight needs only one of its names stored (save_pretrained writes one). The patterns a
    model class lists for from_pretrained to ignore (``_keys_to_ignore_on_load_missing`` /
    ``_unexpected``, e.g. rotary frequencies older files hold) are ignored alike.
    """
    weights = model.state_dict()
    tied = _tied_names(model)
    problems = []
    for name, tensor in weights.items():
        if name in stored:
            if stored[name] != list(tensor.shape):
                problems.append(f"{name} is {stored[name]} there, {list(tensor.shape)} in the model")
        elif not tied.get(name, set()) & stored.keys() and not _ignored(model._keys_to_ignore_on_load_missing, name):
            problems.append(f"it has no {name}")
    for name in stored:
        if name not in weights and not _ignored(model._keys_to_ignore_on_load_unexpected, name):
            problems.append(f"the model has no {name}")
    return problems


def check_fits(folder: str, config_path: str, model: nn.Module) -> None:
    """ConfigError unless the weights in ``folder`` are those of ``model`` (built from ``config_path`` on the meta device)."""
    fix = (f"drop --model.config (it defaults to {folder}), or give the config these weights were saved with"
           if os.path.abspath(config_path) not in (os.path.abspath(folder), os.path.join(os.path.abspath(folder), "config.json"))
           else "the folder's config.json and its weights disagree: save the model again with save_pretrained")
    stored_type, built_type = model_type(folder), model.config.model_type
    if stored_type is not None and stored_type != built_type:
        raise ConfigError(f"{FLAG} {folder} holds a {stored_type} model, but --model.config {config_path} is {built_type}; {fix}")
    problems = mismatches(model, stored_shapes(folder))
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise ConfigError(
            f"{FLAG} {folder} does not fit --model.config {config_path}: {'; '.join(problems[:2])}{more}; {fix}"
        )


@torch.no_grad()
def load(folder: str, state_dict: dict[str, torch.Tensor]) -> None:
    """Read ``state_dict``'s weights (this rank's shards, in place) from the safetensors files in ``folder``.

    The names the files lack are the second names of tied weights (check_fits allowed no other):
    the tensor is read under its stored name.
    """
    stored = stored_shapes(folder)
    dcp.load({name: tensor for name, tensor in state_dict.items() if name in stored},
             storage_reader=HuggingFaceStorageReader(folder))
