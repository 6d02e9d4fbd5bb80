"""Parse a flame job config: TOML < CLI, torchtitan's JobConfig + flame's fields.

Parsing only parses: it refuses what cannot be read (an unknown key or flag, a value of the wrong
type, a TOML file that is not one, a retired spelling), resolves older spellings and expands ``~`` and
environment variables in every path (flame.config.paths); every check of
the values, the model and the data, and the memory plan, run afterwards in ``flame.prepare``. It
imports nothing of the models, the planner, the parallelisms or the trainer. Errors are
``ConfigError``: one line saying what is wrong and what to change. What parsing changed of what was
written (older keys read as today's, a job file's dataset settings reset) is logged, once, by ``parse``.
"""

import difflib
import logging
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import tomllib
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.tools.logging import logger

from flame.config import job as flame_config
from flame.config.paths import expand_paths
from flame.config.spellings import MOVED_JOB_FILES
from flame.config.merge import (
    CLI,
    TOML,
    check_command_line,
    check_unused_fields,
    dotted_fields,
    merge_configs,
    read_older_keys,
    rename_older_flags,
    reset_dataset_dependents,
    resolve_aliases,
    take_torchtitan_float8,
    type_mismatch,
)
from flame.base.errors import ConfigError
from flame.base.paths import expand

# configs/ ships inside the package (flame/configs; the checkout's top-level configs/ links there), so
# "configs/llama_340M.json" resolves in a checkout and in an installed wheel alike
FLAME_PACKAGE = Path(__file__).resolve().parents[1]
CONFIG_MODULE = "flame.config.job"


def resolve_path(path: str) -> str:
    """A path as given if it exists, else one of flame's shipped files (configs/...) from any directory; a job
    file under the path earlier flame versions kept it at (flame/models/fla.toml) is found where it is now."""
    if not path or os.path.exists(path) or os.path.isabs(path):
        return path
    path = MOVED_JOB_FILES.get(os.path.normpath(path), path)
    shipped = FLAME_PACKAGE / path
    return str(shipped) if shipped.exists() else path


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
        self.notes: list[tuple[int, str]] = []  # (logging level, line) for parse to log
        args, renamed = rename_older_flags(list(args))
        if renamed:
            self.notes.append((logging.INFO, f"read older options as today's: {', '.join(renamed)}"))
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
                    args[i] = f"{key}={resolve_path(expand(value, key))}"
                elif i + 1 < len(args):
                    args[i + 1] = resolve_path(expand(args[i + 1], key))
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
        self._toml: dict[str, Any] = {}
        return super().parse_args([f"--job.custom_config_module={CONFIG_MODULE}", *args])

    def _maybe_load_toml(self, args: list[str]) -> dict[str, Any] | None:
        """The job file's table, the keys of older job files read (or refused) first."""
        toml = super()._maybe_load_toml(args)
        if toml:
            self.notes.extend((logging.INFO, note) for note in read_older_keys(toml, self._toml_path))
            self._toml = toml
        return toml

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
        """torchtitan's hook at the end of parsing: flame's spellings resolved, unused fields refused, ``~`` and
        environment variables expanded in every path."""
        self.given = dict.fromkeys(self._in_toml, TOML) | dict.fromkeys(self._on_cli, CLI)
        defaults = type(self.config)()
        if note := take_torchtitan_float8(self.config, defaults):
            self.notes.append((logging.INFO, note))
        check_unused_fields(self.config, defaults)
        resolve_aliases(self.config, self.given)
        expand_paths(self.config)
        reset = reset_dataset_dependents(self.config, defaults, self.given, self._toml)
        self.notes.extend((logging.WARNING, note) for note in reset)


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


def split_list(value: str | None, paths: bool = False) -> list[str]:
    """A comma list as flame reads it: 'a,,b' -> ['a', '', 'b']; None -> [].

    ``paths``: a list of paths (--training.dataset), where a file or folder whose name holds a comma
    (``a,b.jsonl``) is one entry when it exists: of the ways to join the next pieces, the longest that
    names an existing path is taken.
    """
    if value is None:
        return []
    pieces = value.split(",")
    if not paths:
        return [piece.strip() for piece in pieces]
    entries, start = [], 0
    while start < len(pieces):
        end = next((end for end in range(len(pieces), start + 1, -1)
                    if os.path.exists(",".join(pieces[start:end]).strip())), start + 1)
        entries.append(",".join(pieces[start:end]).strip())
        start = end
    return entries


@dataclass
class ParsedJob:
    """A job config as parsed, not yet prepared (flame.prepare checks it and applies the memory plan)."""

    config: JobConfig
    given: dict[str, int] = field(default_factory=dict)  # dotted names the TOML file (TOML) and command line (CLI) set


def parse(args: list[str]) -> ParsedJob:
    """Parse a job's flags (and its --job.config_file); raise ConfigError on what cannot be parsed."""
    manager = FlameConfigManager()
    config = manager.parse_args(list(args))
    for level, note in manager.notes:
        logger.log(level, note)
    return ParsedJob(config, manager.given)
