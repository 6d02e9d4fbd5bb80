"""Parse and check a flame job config: TOML < CLI, torchtitan's JobConfig + flame's fields.

Every check here runs before any process group, dataset or model exists, so a bad
setting costs seconds, not GPU time. Errors are ``ConfigError``: one line saying what is
wrong and what to change.
"""

import difflib
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import tomllib
from torchtitan.config import ConfigManager, JobConfig

from flame import config as flame_config
from flame import config_limits, device, memory
from flame.components import evaluation
from flame.config_fields import (
    CLI,
    TOML,
    check_command_line,
    check_unused_fields,
    dotted_fields,
    merge_configs,
    resolve_aliases,
    type_mismatch,
)
from flame.distributed.degrees import check_fsdp_options, data_parallel_degree
from flame.errors import ConfigError

FLAME_ROOT = Path(__file__).resolve().parent.parent
CONFIG_MODULE = "flame.config"


def resolve_path(path: str) -> str:
    """A path as given if it exists, else relative to the flame checkout (for configs/...)."""
    if not path or os.path.exists(path) or os.path.isabs(path):
        return path
    in_repo = FLAME_ROOT / path
    return str(in_repo) if in_repo.exists() else path


def _flag(arg: str) -> tuple[str, str]:
    """'--a.b-c=v' -> ('--a.b_c', 'v'): the flag as tyro accepts it in either spelling."""
    key, _, value = arg.partition("=")
    return ("--" + key[2:].replace("-", "_") if key.startswith("--") else key), value


def _given_on_cli(args: list[str]) -> set[str]:
    """The dotted names the command line sets ('--training.no-varlen' sets training.varlen)."""
    names = set()
    for arg in args:
        key, _ = _flag(arg)
        if key.startswith("--") and "." in key:
            section, _, name = key[2:].rpartition(".")
            names.update((f"{section}.{name}", f"{section}.{name.removeprefix('no_')}"))
    return names


class FlameConfigManager(ConfigManager):
    """torchtitan's ConfigManager with flame's fields, aliases and up-front checks."""

    def parse_args(self, args: list[str] = sys.argv[1:]) -> JobConfig:
        args = list(args)
        for i, arg in enumerate(args):
            key, value = _flag(arg)
            if key == "--job.custom_config_module":
                given = value or (args[i + 1] if i + 1 < len(args) else "")
                if given != CONFIG_MODULE:
                    raise ConfigError(
                        f"--job.custom_config_module is set by flame ({CONFIG_MODULE}); remove it"
                    )
            if key == "--job.config_file":
                if value:
                    args[i] = f"{key}={resolve_path(value)}"
                elif i + 1 < len(args):
                    args[i + 1] = resolve_path(args[i + 1])
        config_files = [args[i + 1] if not value and i + 1 < len(args) else value
                        for i, (key, value) in enumerate(map(_flag, args)) if key == "--job.config_file"]
        if len(config_files) > 1:  # torchtitan would read the first and ignore the others
            raise ConfigError(
                f"--job.config_file is given {len(config_files)} times ({', '.join(config_files)}); give one "
                "job file and put the other's settings on the command line (they override the file)"
            )
        # tyro refuses a bad flag in a boxed screenful; check_command_line says it in one line
        check_command_line(merge_configs(JobConfig, flame_config.JobConfig), args)
        config_file = self._config_file(args)
        if config_file is not None:
            _check_toml(config_file)
        self._toml_path = config_file
        # which settings the command line and the TOML file give, for resolve_aliases
        self._on_cli = _given_on_cli(args)
        self._in_toml: set[str] = set()
        return super().parse_args([f"--job.custom_config_module={CONFIG_MODULE}", *args])

    @staticmethod
    def _config_file(args: list[str]) -> str | None:
        for i, arg in enumerate(args):
            key, value = _flag(arg)
            if key == "--job.config_file":
                return value or (args[i + 1] if i + 1 < len(args) else None)
        return None

    def _dict_to_dataclass(self, cls, data: dict[str, Any], prefix: str = "") -> Any:
        """TOML table -> dataclass; an unknown key names the closest valid one."""
        if not is_dataclass(cls):
            return data
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in data.items():
            self._in_toml.add(f"{prefix}{key}")
            if key not in known:
                full = f"{prefix}{key}"
                valid = dotted_fields(cls, prefix) + [prefix + name for name in known]
                close = difflib.get_close_matches(full, valid, n=1, cutoff=0.6)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                section = f"[{prefix[:-1]}]" if prefix else "top level"
                raise ConfigError(
                    f"unknown key '{full}' ({section} of {self._toml_path}){hint} "
                    "Run `bash train.sh -h` for every valid key"
                )
            ftype = known[key].type
            if (expected := type_mismatch(ftype, value)) is not None:
                raise ConfigError(
                    f"'{prefix}{key}' in {self._toml_path} is {value!r} ({type(value).__name__}), but it takes "
                    f"{expected}; write it as a TOML {expected}"
                )
            if is_dataclass(ftype) and isinstance(value, dict):
                values[key] = self._dict_to_dataclass(ftype, value, f"{prefix}{key}.")
            else:
                values[key] = value
        return cls(**values)

    _merge_configs = staticmethod(merge_configs)  # flame's field help reaches -h

    def _validate_config(self) -> None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        given = dict.fromkeys(self._in_toml, TOML) | dict.fromkeys(self._on_cli, CLI)
        finalize(self.config, world_size, given)


def _check_toml(path: str) -> None:
    """A job file that exists and parses as TOML (torchtitan would print a traceback)."""
    if os.path.isdir(path):
        raise ConfigError(f"--job.config_file {path} is a directory; give the job's .toml file (e.g. configs/debug.toml)")
    if not os.path.isfile(path):
        raise ConfigError(f"--job.config_file {path} does not exist; give the job's .toml file (e.g. configs/debug.toml)")
    try:
        with open(path, "rb") as f:
            tomllib.load(f)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}; fix that line") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not a text file (byte {error.start} is not UTF-8); give the job's .toml file") from None
    except OSError as error:
        raise ConfigError(f"cannot read --job.config_file {path}: {error.strerror}") from None


def split_list(value: str | None) -> list[str]:
    """A comma list as flame reads it: 'a,,b' -> ['a', '', 'b']; None -> []."""
    return [] if value is None else [item.strip() for item in value.split(",")]


def _check_model(config: JobConfig, given: dict[str, int]) -> None:
    model = config.model
    if model.init_from:  # its folder, found once (offline), gives the model config and tokenizer
        # imported here: it imports transformers, which only the jobs that use it need to parse
        from flame.models import init_from

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
        if any(os.path.isfile(os.path.join(config_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            model.tokenizer_path = config_dir
        else:
            raise ConfigError(
                "no tokenizer given: set --model.tokenizer_path (a directory, a hub name in the "
                "local HF cache, or builtin:python-stdlib-bpe)"
            )
    elif not model.tokenizer_path.startswith("builtin:"):
        model.tokenizer_path = resolve_path(model.tokenizer_path)


def _check_training(config: JobConfig) -> None:
    t = config.training
    if not t.dataset:
        raise ConfigError("no dataset given: set --training.dataset (e.g. builtin:python-stdlib or a path)")
    if t.seq_len <= 0:
        raise ConfigError(f"--training.seq_len must be positive, got {t.seq_len}")
    if t.context_len is None:
        t.context_len = t.seq_len
    if t.context_len <= 0 or t.context_len > t.seq_len:
        raise ConfigError(
            f"--training.context_len {t.context_len} must be between 1 and --training.seq_len {t.seq_len}"
        )
    if t.local_batch_size <= 0:
        raise ConfigError(f"--training.batch_size must be positive, got {t.local_batch_size}")
    if t.varlen and t.local_batch_size != 1:
        raise ConfigError(
            f"--training.varlen packs one row per device but --training.batch_size is {t.local_batch_size}: "
            "set --training.batch_size 1 and raise --training.seq_len instead"
        )
    if t.gradient_accumulation_steps < 1:
        raise ConfigError(
            f"--training.gradient_accumulation_steps must be >= 1, got {t.gradient_accumulation_steps}"
        )
    if t.steps < 1 and not config.checkpoint.create_seed_checkpoint:
        raise ConfigError(
            f"--training.steps must be >= 1 (optimizer steps to train), got {t.steps}; to write initial weights "
            "without training, use --checkpoint.create_seed_checkpoint"
        )
    if t.max_norm <= 0:
        raise ConfigError(f"--training.max_norm must be positive, got {t.max_norm}")
    for name in ("num_workers", "shuffle_buffer", "row_shuffle_buffer", "data_shards", "max_skipped_steps"):
        value = t.dataloader.num_workers if name == "num_workers" else getattr(t, name)
        if value < 0:
            raise ConfigError(f"--training.{name} must be >= 0, got {value}")
    datasets = split_list(t.dataset)
    for name in ("dataset_name", "dataset_split", "data_dir", "data_files", "data_format"):
        entries = split_list(getattr(t, name))
        if entries and len(entries) not in (1, len(datasets)):
            raise ConfigError(
                f"--training.{name} has {len(entries)} entries for {len(datasets)} datasets: "
                "give one entry per dataset (empty entries allowed) or a single one for all"
            )
    _check_data_format(t)
    if t.data_probs is not None:
        probs = split_list(t.data_probs)
        if len(probs) != len(datasets):
            raise ConfigError(
                f"--training.data_probs has {len(probs)} entries for {len(datasets)} datasets; give one per dataset"
            )
        try:
            values = [float(p) for p in probs]
        except ValueError:
            raise ConfigError(f"--training.data_probs must be numbers, got {t.data_probs!r}") from None
        if any(v <= 0 for v in values):
            raise ConfigError(f"--training.data_probs must all be positive, got {t.data_probs!r}")
    if config.checkpoint.keep_latest_k == 1:
        raise ConfigError(
            "--checkpoint.keep_latest_k 1 could delete the only loadable checkpoint during a save: use 0 (keep all) or >= 2"
        )
    if config.checkpoint.keep_latest_k < 0:
        raise ConfigError(
            f"--checkpoint.keep_latest_k {config.checkpoint.keep_latest_k}: use 0 (keep every checkpoint) or >= 2 "
            "(keep that many of the newest)"
        )
    if config.checkpoint.interval <= 0:
        raise ConfigError(f"--checkpoint.interval must be positive, got {config.checkpoint.interval}")
    if config.metrics.log_freq <= 0:
        raise ConfigError(f"--metrics.log_freq must be positive, got {config.metrics.log_freq}")


def _check_data_format(t) -> None:
    formats = {entry or "text" for entry in split_list(t.data_format)}
    if unknown := formats - {"text", "sft"}:
        raise ConfigError(f"--training.data_format {t.data_format}: {', '.join(sorted(unknown))} is not a format; "
                          "give text or sft per dataset")
    if "sft" in formats and not t.document_mask:
        raise ConfigError("--training.data_format sft keeps each conversation a document of its own: "
                          "drop --training.no-document_mask")
    if "sft" not in formats and (t.truncate_long or t.sft_loss_on != "completion"):
        flag = "--training.truncate_long" if t.truncate_long else f"--training.sft_loss_on {t.sft_loss_on}"
        raise ConfigError(f"{flag} applies to SFT sources, and no dataset is one: set --training.data_format sft "
                          "for the chat datasets, or drop the flag")


def _check_seed_checkpoint(config: JobConfig, world_size: int) -> None:
    if not config.checkpoint.create_seed_checkpoint:
        return
    if world_size != 1:
        raise ConfigError(
            f"--checkpoint.create_seed_checkpoint writes unsharded initial weights from one process, but this job has "
            f"{world_size}: run it with NGPU=1 (one node), then start any layout from it"
        )
    if not config.checkpoint.enable:
        raise ConfigError("--checkpoint.create_seed_checkpoint saves a checkpoint: drop --checkpoint.no-enable")


def finalize(config: JobConfig, world_size: int, given: dict[str, int]) -> None:
    """Resolve aliases and defaults that depend on other fields; raise ConfigError on bad input.

    ``given``: the dotted names the TOML file and the command line set (see resolve_aliases).
    """
    defaults = type(config)()
    check_unused_fields(config, defaults)
    resolve_aliases(config, given)
    if config.model.name != "flame":
        raise ConfigError(f"--model.name {config.model.name}: flame trains HF/fla models only; leave it unset")
    _check_model(config, given)
    _check_training(config)
    config_limits.check(config, given)
    dp = data_parallel_degree(config, world_size)
    device.check_supported(config)
    check_fsdp_options(config, world_size)
    _check_seed_checkpoint(config, world_size)
    evaluation.check(config)
    memory.apply(config, world_size, given)  # may split batch_size into micro-batches: the global batch stays
    config.training.global_batch_size = config.training.local_batch_size * dp * config.training.gradient_accumulation_steps
