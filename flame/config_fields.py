"""How flame's config fields meet torchtitan's: the merged JobConfig, older spellings, unused fields.

- ``merge_configs`` builds the JobConfig that torchtitan parses: its dataclasses with flame's
  (``flame.config``) merged in, so that ``-h`` shows the help of flame's fields too.
- ``resolve_aliases`` copies each older spelling given (``flame.config.ALIASES``) onto the
  torchtitan field it stands for, and refuses the spellings whose meaning is gone
  (``REFUSED_SPELLINGS``) with the one to use instead.
- ``check_unused_fields`` refuses torchtitan fields flame does not act on
  (``UNUSED_TORCHTITAN_FIELDS``), so that no setting is silently ignored.
"""

import types
import typing
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any

from flame.config import (
    ALIAS_VALUES,
    ALIASES,
    REFUSED_SPELLINGS,
    UNUSED_TORCHTITAN_FIELDS,
)
from flame.errors import ConfigError

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
        value = ALIAS_VALUES.get(alias, lambda same: same)(given_value)
        current = _get(config, target)
        if levels.get(target) == level and current != value:
            raise ConfigError(f"--{alias} ({given_value}) and --{target} ({current}) are the same setting; give only one")
        _set(config, target, value)
        levels[target] = level  # a second alias of the same field is checked against this one


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
