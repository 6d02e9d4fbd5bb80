"""How flame's config fields meet torchtitan's: the merged JobConfig, older spellings, unused fields.

- ``merge_configs`` builds the JobConfig that torchtitan parses: its dataclasses with flame's
  (``flame.config.job``) merged in, so that ``-h`` shows the help of flame's fields too.
- ``resolve_aliases`` copies each older spelling given (``flame.config.spellings.ALIASES``) onto the
  torchtitan field it stands for, and refuses the spellings whose meaning is gone
  (``REFUSED_SPELLINGS``) with the one to use instead.
- ``check_unused_fields`` refuses torchtitan fields flame does not act on
  (``UNUSED_TORCHTITAN_FIELDS``), so that no setting is silently ignored.
- ``check_command_line`` refuses an unknown option, a switch given a value, or a value that
  does not fit its option's type, in one line (tyro's own messages span a boxed screen).
- ``read_older_keys`` and ``rename_older_flags`` read the keys of older job files and command lines
  that today's JobConfig has no field for (``OLDER_KEYS``).
- ``reset_dataset_dependents`` drops the job file's per-dataset settings when the command line names
  other datasets (``DATASET_DEPENDENTS``).
"""

import difflib
import json
import types
import typing
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any

from flame.config.spellings import (
    ALIAS_VALUES,
    ALIASES,
    OLDER_KEYS,
    REFUSED_SPELLINGS,
    UNUSED_TORCHTITAN_FIELDS,
)
from flame.base.errors import ConfigError

TOML, CLI = 1, 2  # where a setting is given; the command line overrides the TOML file


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def dotted_fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of a config dataclass, as dotted names ('training.dataloader.num_workers')."""
    names = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        if is_dataclass(f.type):
            names.extend(dotted_fields(f.type, name + "."))
        else:
            names.append(name)
    return names


def merge_configs(base: type, custom: type) -> type:
    """torchtitan's config dataclass ``base`` with flame's ``custom`` merged in, section by section.

    A field in both takes flame's type and default. The merged class derives from flame's class
    and torchtitan's, in that order: tyro reads each field's help from the docstrings of the
    class's bases, so flame's own help shows in ``-h`` (torchtitan's merge keeps only its own
    class as the base, and flame's fields would show no help).
    """
    custom_fields = {f.name: f for f in fields(custom)}
    specs: list[tuple[str, Any, Any]] = []
    for f in fields(base):
        mine = custom_fields.pop(f.name, None)
        if mine is not None and is_dataclass(f.type) and is_dataclass(mine.type):
            section = merge_configs(f.type, mine.type)
            specs.append((f.name, section, field(default_factory=section)))
        else:
            chosen = mine or f
            specs.append((f.name, chosen.type, chosen))
    specs.extend((f.name, f.type, f) for f in custom_fields.values())
    return make_dataclass(f"Merged{base.__name__}", specs, bases=(custom, base))


def resolve_aliases(config: Any, given: dict[str, int]) -> None:
    """Refuse the retired spellings given, and copy each alias given onto the field it stands for.

    ``given`` maps the dotted names that the TOML file (TOML) and the command line (CLI) set.
    Either spelling on the command line overrides the other one in the TOML file, as any flag
    does; two spellings of one setting at the same level must agree.
    """
    for name, fix in REFUSED_SPELLINGS.items():
        if name in given:
            raise ConfigError(f"--{name} is no longer a flame option: {fix}")
    levels = dict(given)
    for alias, target in ALIASES.items():
        level = levels.get(alias, 0)
        if not level or levels.get(target, 0) > level:
            continue
        given_value = _get(config, alias)
        if given_value is None:  # '--training.batch_size None': no value for the field it stands for
            raise ConfigError(f"--{alias} needs a value (it sets --{target}); give one, or leave --{alias} out")
        value = ALIAS_VALUES.get(alias, lambda same: same)(given_value)
        current = _get(config, target)
        if levels.get(target) == level and current != value:
            raise ConfigError(f"--{alias} ({given_value}) and --{target} ({current}) are the same setting; give only one")
        _set(config, target, value)
        levels[target] = level  # a second alias of the same field is checked against this one


# torchtitan's names of its FP8 converter (0.1 and 0.2): model.converters names it, quantize.linear.float8 holds its settings
TORCHTITAN_FLOAT8 = ("float8", "quantize.linear.float8")
_AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's filter_fqns entry for "skip the layers too small to gain"
_TORCHTITAN_HEAD = "output"  # torchtitan's name of the output head, which flame never converts


def take_torchtitan_float8(config: Any, defaults: Any) -> str | None:
    """torchtitan's FP8 setting (model.converters naming its float8 converter, quantize.linear.float8.*) moved onto
    flame's float8 section, and the torchtitan fields reset; returns a note saying so, None when not given.

    torchtitan converts every eligible layer; its ``auto_filter_small_kn`` entry becomes flame's measured choice
    (float8.layers auto), and its ``output`` entry (its models' head) is dropped: flame never converts the head. Other
    converters stay for ``check_unused_fields`` to refuse.
    """
    converters = list(config.model.converters)
    if not any(name in TORCHTITAN_FLOAT8 for name in converters):
        return None
    theirs = config.quantize.linear.float8
    if theirs.emulate:
        raise ConfigError("quantize.linear.float8.emulate: flame emulates the FP8 matmuls on CPUs by itself and runs "
                          "them natively on GPUs; leave emulate out")
    recipe = theirs.recipe_name or "tensorwise"
    mine = config.float8
    if mine.recipe_name != defaults.float8.recipe_name and mine.recipe_name != recipe:
        raise ConfigError(f"model.converters turns on torchtitan's float8 ({recipe}) and --float8.recipe_name is "
                          f"{mine.recipe_name}: they are the same setting; give only --float8.recipe_name")
    mine.recipe_name = recipe
    mine.layers = "auto" if _AUTO_FILTER in theirs.filter_fqns else "all"
    mine.filter_fqns = [*mine.filter_fqns, *(name for name in theirs.filter_fqns
                                             if name not in (_AUTO_FILTER, _TORCHTITAN_HEAD))]
    mine.enable_fsdp_float8_all_gather = theirs.enable_fsdp_float8_all_gather
    mine.precompute_float8_dynamic_scale_for_fsdp = theirs.precompute_float8_dynamic_scale_for_fsdp
    config.model.converters = [name for name in converters if name not in TORCHTITAN_FLOAT8]
    config.quantize.linear.float8 = defaults.quantize.linear.float8
    return (f"model.converters' float8 read as --float8.recipe_name {recipe} --float8.layers {mine.layers}"
            + (f" --float8.filter_fqns {','.join(mine.filter_fqns)}" if mine.filter_fqns else ""))


def check_unused_fields(config: Any, defaults: Any) -> None:
    """Refuse a torchtitan field (or any field of a section) flame does not act on, set off its default."""
    for entry, why in UNUSED_TORCHTITAN_FIELDS.items():
        section = _get(defaults, entry)
        names = dotted_fields(type(section), f"{entry}.") if is_dataclass(section) else [entry]
        for name in names:
            if _get(config, name) != _get(defaults, name):
                raise ConfigError(f"--{name} is a torchtitan option flame does not use: {why}")


def type_mismatch(annotation: Any, value: Any) -> str | None:
    """What a TOML value of a field annotated ``annotation`` should be, when ``value`` is not that; else None.

    Checks the scalar types flame's and torchtitan's fields use (bool, int, float, str, their
    optional forms and Literals); other annotations are left to the field's own checks.
    """
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    options = tuple(option for option in options if option is not type(None))
    if value is None or len(options) != 1:
        return None
    expected = options[0]
    if typing.get_origin(expected) is typing.Literal:
        choices = typing.get_args(expected)
        return None if value in choices else "one of " + ", ".join(repr(choice) for choice in choices)
    names = {bool: "boolean (true/false)", int: "integer", float: "number", str: "string"}
    if expected not in names:
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return None  # 1 is a fine float
    fits = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    return None if fits else names[expected]


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _options(annotation: Any) -> tuple[tuple[Any, ...], bool]:
    """(the types an annotation allows besides None, whether it allows None): 'int | None' -> ((int,), True)."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    options = typing.get_args(annotation) if union else (annotation,)
    return tuple(option for option in options if option is not type(None)), type(None) in options


def _cli_value_error(options: tuple[Any, ...], optional: bool, value: str) -> str | None:
    """What an option of these types takes, when the command-line text ``value`` is not that; else None."""
    if optional and value == "None":
        return None
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            if value in typing.get_args(option):
                return None
            continue
        try:
            option(value)  # int, float or str, as tyro converts them
            return None
        except ValueError:
            continue
    return " or ".join(
        "one of " + ", ".join(repr(c) for c in typing.get_args(option)) if typing.get_origin(option) is typing.Literal
        else _TYPE_NAMES[option] for option in options
    )


def check_command_line(config_cls: type, args: list[str]) -> None:
    """Refuse what tyro would refuse in a screenful: an unknown option (naming the closest one), a value
    given to a switch, a missing value, or a value that is not of its option's type.

    ``args`` as flame gives them to tyro: ``--section.key value``, ``--section.key=value``, switches
    ``--section.flag`` / ``--section.no-flag``; hyphens and underscores alike in keys.
    """
    if any(arg in ("-h", "--help") for arg in args):
        return  # tyro prints the help
    annotations = {}
    for name in dotted_fields(config_cls):
        annotations[name] = _get_field(config_cls, name).type
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}: every option is --section.key value (e.g. --training.steps 100); "
                "run `bash train.sh -h` for every option"
            )
        key, _, inline = arg.partition("=")
        name = key[2:].replace("-", "_")
        section, _, leaf = name.rpartition(".")
        negated = f"{section}.{leaf.removeprefix('no_')}" if leaf.startswith("no_") else None
        if name not in annotations and annotations.get(negated) is not bool:
            if (older := OLDER_KEYS.get(name) or OLDER_KEYS.get(negated)) is not None:
                raise ConfigError(f"--{name} is no longer a flame option: {older.fix}")
            close = difflib.get_close_matches(name, annotations, n=1, cutoff=0.6)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise ConfigError(f"unknown option --{name}{hint} Run `bash train.sh -h` for every option")
        annotation = annotations.get(name, bool)
        following = args[i + 1] if i + 1 < len(args) else None
        if annotation is bool:
            value = inline if "=" in arg else (following if following is not None and not following.startswith("--") else None)
            if value is not None:
                on, off = f"--{section}.{leaf.removeprefix('no_')}", f"--{section}.no-{leaf.removeprefix('no_')}"
                raise ConfigError(f"--{name} is a switch and takes no value ({value!r}): write {on} to turn it on, {off} to turn it off")
            i += 1
            continue
        if "=" not in arg:
            if following is None or following.startswith("--"):
                raise ConfigError(f"--{name} needs a value (--{name} VALUE)")
            inline, i = following, i + 1
        i += 1
        options, optional = _options(annotation)
        if not all(option in _TYPE_NAMES or typing.get_origin(option) is typing.Literal for option in options):
            continue  # lists (comma lists on the command line): tyro parses them, flame's checks follow
        if (expected := _cli_value_error(options, optional, inline)) is not None:
            raise ConfigError(f"--{name} takes {expected}, not {inline!r}")


def rename_older_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` with each older option that stands for one of today's (``OLDER_KEYS``' ``becomes``) renamed to it
    ('--job.print_args' -> '--job.print_config', '--x.no-older' -> '--y.no-today'), and the renames, as
    'older as today'. Other older options stay, for ``check_command_line`` to refuse with their fix."""
    renamed, result = [], []
    for arg in args:
        key, equals, value = arg.partition("=")
        name = key[2:].replace("-", "_") if key.startswith("--") else ""
        section, _, leaf = name.rpartition(".")
        negated = leaf.startswith("no_") and name not in OLDER_KEYS
        older = OLDER_KEYS.get(f"{section}.{leaf.removeprefix('no_')}" if negated else name)
        if older is None or not older.becomes:
            result.append(arg)
            continue
        today_section, _, today_leaf = older.becomes.rpartition(".")
        today = f"--{today_section}.no-{today_leaf}" if negated else f"--{older.becomes}"
        result.append(today + equals + value)
        renamed.append(f"--{name} as {today}")
    return result, renamed


def _leaves(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, value) of every value of a TOML table, its tables walked."""
    leaves = []
    for key, value in table.items():
        if isinstance(value, dict):
            leaves.extend(_leaves(value, f"{prefix}{key}."))
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def _take(table: dict[str, Any], dotted: str) -> None:
    """Remove a value from a TOML table, and the tables that removing it empties."""
    *parents, last = dotted.split(".")
    chain = [table]
    for part in parents:
        chain.append(chain[-1][part])
    del chain[-1][last]
    for parent, part in zip(reversed(chain[:-1]), reversed(parents)):
        if parent[part]:
            break
        del parent[part]


def read_older_keys(toml: dict[str, Any], where: str) -> list[str]:
    """Take the keys of older flame and torchtitan job files out of the TOML table ``toml`` (read from ``where``):
    each that stands for one of today's fields moves onto it; each whose value changes nothing goes; any
    other value is refused with what to do instead. The notes to log: what was read as what, what changed nothing.
    """
    moved, inert = [], []
    for name, value in _leaves(toml):
        older = OLDER_KEYS.get(name)
        if older is None:
            continue  # today's key, or one that the JobConfig refuses as unknown
        _take(toml, name)
        if older.becomes:
            *parents, last = older.becomes.split(".")
            table = toml
            for part in parents:
                table = table.setdefault(part, {})
            if last in table and table[last] != value:
                raise ConfigError(
                    f"'{name}' ({json.dumps(value, default=str)}) and '{older.becomes}' ({json.dumps(table[last])}) in {where} are "
                    f"the same setting; give only '{older.becomes}'"
                )
            table[last] = value
            moved.append(f"{name} as {older.becomes}")
        elif older.changes_nothing(value):
            inert.append(f"{name} = {json.dumps(value, default=str)}")
        else:
            raise ConfigError(f"'{name} = {json.dumps(value, default=str)}' in {where} is no longer a flame option: {older.fix}")
    notes = []
    if moved:
        notes.append(f"{where}: read older keys as today's: {', '.join(moved)}; rename them to keep the file current")
    if inert:
        notes.append(f"{where}: older keys that change nothing in flame, accepted: {', '.join(inert)}; remove them")
    return notes


# each dataset option -> the settings that describe the datasets it names, entry by entry (flame.data.sources)
DATASET_DEPENDENTS: dict[str, tuple[str, ...]] = {
    "training.dataset": tuple(f"training.{name}" for name in (
        "dataset_name", "dataset_split", "data_dir", "data_files", "data_format", "data_probs", "text_column",
    )),
    "validation.dataset": tuple(f"validation.{name}" for name in (
        "dataset_name", "dataset_split", "data_dir", "data_files", "data_format",
    )),
}


def reset_dataset_dependents(config: Any, defaults: Any, given: dict[str, int], toml: dict[str, Any]) -> list[str]:
    """Reset what the job file says about its datasets (``DATASET_DEPENDENTS``) once the command line names others.

    A job file's ``dataset_name = "sample-100BT"`` describes the job file's dataset; kept beside another
    dataset from the command line it would ask that one for a configuration it may not have. Each such
    setting the TOML file gave and the command line did not goes back to its default and out of ``given``.
    ``toml``: the job file's table. The warnings to log, one per dataset option.
    """
    notes = []
    for option, dependents in DATASET_DEPENDENTS.items():
        section, _, key = option.partition(".")
        if given.get(option) != CLI or _get(config, option) == toml.get(section, {}).get(key, _get(defaults, option)):
            continue
        stale = [name for name in dependents if given.get(name) == TOML]
        if not stale:
            continue
        values = ", ".join(f"{name} (was {json.dumps(_get(config, name))})" for name in stale)
        for name in stale:
            _set(config, name, _get(defaults, name))
            del given[name]
        notes.append(
            f"--{option} on the command line replaces the job file's datasets, and what the job file says of them "
            f"is reset to the defaults: {values}; to keep one, give it on the command line"
        )
    return notes


def _get_field(cls: type, dotted: str):
    *parents, last = dotted.split(".")
    for part in parents:
        cls = next(f.type for f in fields(cls) if f.name == part)
    return next(f for f in fields(cls) if f.name == last)
