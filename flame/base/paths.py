"""Paths as their user means them: ``~`` and environment variables expanded, wherever a path is read.

A shell expands ``~`` and ``$VAR`` in a word of its own, but not in ``--flag=~/x``, in quotes, or in
a TOML file; flame expands them in every path it reads (the job's paths: flame.config.paths; the
subcommands' path arguments: flame.base.cli), so ``~/runs/x`` never becomes a folder named ``~``.
A variable that is not set is refused rather than kept as text: ``$SCRATCH/run`` would otherwise
become a folder named ``$SCRATCH`` in the current directory.
"""

import os
import re

from flame.base.errors import ConfigError

_VARIABLE = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def expand(path: str, flag: str) -> str:
    """``path`` with ``~`` and ``$VAR``/``${VAR}`` expanded; ConfigError naming ``flag`` for a variable that is not set."""
    if "$" in path:
        unset = [name for match in _VARIABLE.finditer(path)
                 if (name := match["braced"] if match["braced"] is not None else match["plain"]) not in os.environ]
        if unset:
            raise ConfigError(f"{flag} {path} names the environment variable {unset[0]}, which is not set; set it, "
                              "or write the path out")
        path = os.path.expandvars(path)
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):  # ~name of no user on this machine
        raise ConfigError(f"{flag} {path}: there is no user {expanded.split(os.sep)[0][1:]!r} on this machine for "
                          f"{expanded.split(os.sep)[0]} to name the home of; write the path out")
    return expanded


def expand_list(value: str, flag: str) -> str:
    """A comma list of paths (--training.dataset a.jsonl,~/b.jsonl) with each entry expanded."""
    entries = value.split(",")  # a name holding a comma splits here too, and joins again unchanged
    return ",".join(entry[:len(entry) - len(entry.lstrip())] + expand(entry.lstrip(), flag) for entry in entries)
