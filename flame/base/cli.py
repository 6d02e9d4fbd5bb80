"""The one flag style of flame's commands: words joined by underscores, as the training flags spell them.

``flame train`` takes torchtitan's dotted flags (``--training.seq_len``); the other subcommands
(``flame export``, ``flame plot``, ``flame push``, ...) parse with ``ArgumentParser`` below, so a
flag reads the same everywhere: ``--export_as``, ``--max_shard_size``. The hyphenated spelling
(``--export-as``) is accepted too, for muscle memory and older scripts, but help and docs show one.
A path argument (``add_argument(..., path=True)``) has ``~`` and environment variables expanded, as the
training flags' paths have, also where the shell leaves them (``--out=~/x``, quoted).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from flame.base.errors import ConfigError
from flame.base.paths import expand


class ArgumentParser(argparse.ArgumentParser):
    """argparse with underscore flags that also answers to their hyphenated spelling."""

    def add_argument(self, *names: str, path: bool = False, **kwargs):
        """argparse's, and ``path=True``: the value names a file or folder, ``~`` and ``$VAR`` expanded (flame.base.paths)."""
        for name in names:
            if name.startswith("--") and "-" in name[2:]:
                raise ValueError(f"{name}: flame's flags join words with underscores ({name[:2]}{name[2:].replace('-', '_')})")
        if path:
            kwargs["type"] = expanded_path
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._underscored(args), namespace)

    def _underscored(self, args: list[str]) -> list[str]:
        """``--max_shard_size=5GB`` -> ``--max_shard_size=5GB`` for this parser's own flags; values untouched."""
        known = {name for action in self._actions for name in action.option_strings}
        out, after_separator = [], False
        for arg in args:
            if arg == "--":
                after_separator = True
            if not after_separator and arg.startswith("--") and "-" in arg[2:]:
                flag, equals, value = arg.partition("=")
                spelled = "--" + flag[2:].replace("-", "_")
                if spelled in known:
                    arg = spelled + equals + value
            out.append(arg)
        return out


def expanded_path(value: str) -> str:
    """An argparse ``type``: the path ``value`` with ``~`` and ``$VAR`` expanded."""
    try:
        return expand(value, "the path")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
