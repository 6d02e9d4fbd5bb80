"""The files a job names, found before anything loads them: its model config, its tokenizer (or the
--model.init_from folder that gives both), a dump folder it can write, and the folders it keeps there.

Paths are taken as given (``~`` and environment variables expanded as the config parsed), else relative
to the flame checkout (``configs/...`` works from anywhere).
"""

import os
from typing import Any

from torchtitan.tools.logging import logger

from flame.base.errors import ConfigError
from flame.config.manager import resolve_path
from flame.config.paths import ABSOLUTE_OPT_IN, outside_dump_folder
from flame.data.tokenizer import TOKENIZER_FILES
from flame.models import init_from


def resolve_model_files(config: Any, given: dict[str, int]) -> None:
    """The model config and tokenizer the job names, found (--model.init_from gives both), or a one-line refusal."""
    model = config.model
    if model.name != "flame":
        raise ConfigError(f"--model.name {model.name}: flame trains HF/fla models only; leave it unset")
    if model.init_from:  # its folder, found once (offline), gives the model config and tokenizer
        init_from.check_other_starts(config.checkpoint)
        model.init_from = init_from.resolve(resolve_path(model.init_from))
        init_from.default_model_files(model, given)
    if not model.config:
        raise ConfigError(
            "no model given: set --model.config to an HF config.json or a directory holding one "
            "(e.g. --model.config configs/llama_4M.json)"
        )
    model.config = resolve_path(model.config)
    give = "give an HF config.json or a directory holding one (e.g. configs/llama_4M.json)"
    if not os.path.exists(model.config):
        raise ConfigError(f"--model.config {model.config} does not exist; {give}")
    if os.path.isdir(model.config) and not os.path.isfile(os.path.join(model.config, "config.json")):
        raise ConfigError(f"--model.config {model.config} is a directory without config.json; {give}")
    if model.tokenizer_path is None:
        config_dir = model.config if os.path.isdir(model.config) else os.path.dirname(model.config)
        # taken when it holds a tokenizer's files; load_tokenizer then refuses one that lacks its vocabulary
        if any(os.path.isfile(os.path.join(config_dir, f)) for f in TOKENIZER_FILES):
            model.tokenizer_path = config_dir
        else:
            raise ConfigError(
                "no tokenizer given: set --model.tokenizer_path (a directory, a hub name in the "
                "local HF cache, or builtin:python-stdlib-bpe)"
            )
    elif not model.tokenizer_path.startswith("builtin:"):
        model.tokenizer_path = resolve_path(model.tokenizer_path)


def check_dump_folder(folder: str) -> None:
    """The dump folder is a folder this user can write, or can be made in one."""
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep))
    existing = existing or "."
    if not os.path.isdir(existing):
        raise ConfigError(
            f"--job.dump_folder {folder}: {existing} is a file, not a folder; choose another --job.dump_folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--job.dump_folder {folder}: {existing} is not writable by this user; choose a folder you can write"
        )


def check_folders_stay_home(config: Any) -> None:
    """The folders a run keeps in its dump folder stay there: a path that leaves it is refused, an absolute one
    accepted only under --job.allow_absolute_folders (and logged)."""
    for dotted, value in outside_dump_folder(config):
        if not os.path.isabs(value):
            raise ConfigError(
                f"--{dotted} {value} leaves the dump folder {config.job.dump_folder}, to which it is relative; give "
                f"a path that stays inside it, or an absolute path with --{ABSOLUTE_OPT_IN}"
            )
        if not config.job.allow_absolute_folders:
            raise ConfigError(
                f"--{dotted} {value} is outside the dump folder {config.job.dump_folder}; keep it inside (a relative "
                f"path), or add --{ABSOLUTE_OPT_IN} to write there"
            )
        logger.info(f"--{dotted} {value}: outside the dump folder {config.job.dump_folder} (--{ABSOLUTE_OPT_IN})")
