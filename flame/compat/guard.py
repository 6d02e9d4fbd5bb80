"""The guard every change flame makes to another library goes through.

A change is a ``Patch``: a named function of one of the seams (``flame.compat.torchtitan``,
``fla``, ``mamba_ssm``, ``triton``, ``transformers``) with the ``Target``s it replaces, wraps or
relies on. Calling the patch checks its targets, applies it, and records it; a second call
does nothing, so a patch is applied once per process however many paths reach it.

What the guard refuses, and what it only reports:
- a target that is missing, or whose shape differs (a callable whose leading parameters are
  not the ones flame passes or replaces, a module without the kernels a patch changes):
  ``ConfigError``, one line naming the target, the version the patch was written for and the
  fix, raised before the change is made. Patching a changed target would fail later, inside a
  step, or silently change nothing.
- an installed version other than the one written for, with every target present: a warning,
  once per library. 3rdparty/requirements.txt pins exact versions, but source checkouts of
  torchtitan and fla under 3rdparty/ are installed editable and carry their own versions;
  their targets, not their version strings, decide whether flame's changes still fit.
"""

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from flame.base.errors import ConfigError

# torchtitan's logger (the root logger), without importing torchtitan: loading an export needs none of it
logger = logging.getLogger()


@dataclass(frozen=True)
class Library:
    """A library flame changes: its import name, pip distribution, and the version the changes were written for."""

    name: str
    distribution: str
    written_for: str

    def installed(self) -> str | None:
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:  # e.g. a source checkout installed under another name
            owners = metadata.packages_distributions().get(self.name, [])
            return metadata.version(owners[0]) if owners else None


@dataclass(frozen=True)
class Target:
    """Something of ``library`` that flame replaces, wraps or calls: ``module`` and an attribute path in it.

    ``parameters``: a callable's leading parameter names, as flame passes or replaces them.
    ``holds``/``shape``: any other expectation of the object, and that expectation in words.
    """

    library: Library
    module: str
    name: str = ""
    parameters: tuple[str, ...] | None = None
    holds: Callable[[Any], bool] | None = None
    shape: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    def resolve(self) -> Any:
        """The object itself (AttributeError/ImportError when missing: ``problem`` says it in words)."""
        value = importlib.import_module(self.module)
        for part in filter(None, self.name.split(".")):
            value = getattr(value, part)
        return value

    def problem(self) -> str | None:
        """What is wrong with the installed target, or None."""
        try:
            value = self.resolve()
        except ImportError as error:
            return f"cannot import {self.module} ({error})"
        except AttributeError:
            return f"has no {self.path}"
        if self.parameters is not None:
            try:
                names = tuple(inspect.signature(value).parameters)[: len(self.parameters)]
            except (TypeError, ValueError):
                return f"has a {self.path} that is not a function"
            if names != self.parameters:
                return f"has a {self.path} taking ({', '.join(names)}), not ({', '.join(self.parameters)})"
        if self.holds is not None and not self.holds(value):
            return f"has a {self.path} that is not {self.shape}"
        return None

    def require(self, user: str) -> None:
        """Refuse to start (ConfigError, one line) when this target is missing or changed; ``user`` relies on it."""
        if problem := self.problem():
            lib = self.library
            installed = lib.installed() or "unknown"
            raise ConfigError(
                f"{user} was written for {lib.distribution} {lib.written_for}, and the {lib.distribution} installed here "
                f"({installed}) {problem}: install {lib.distribution}=={lib.written_for} (3rdparty/requirements.txt), "
                f"or adapt {user} to {installed}"
            )
        _report_other_version(self.library)


@functools.cache
def _report_other_version(library: Library) -> None:
    installed = library.installed()
    if installed is not None and installed.split("+")[0] != library.written_for:
        logger.warning(
            f"{library.distribution} {installed} is installed; flame's changes to it (flame.compat.{library.name}) were "
            f"written for {library.written_for}: every target they change is present, but they are untested with it "
            f"(3rdparty/requirements.txt pins {library.distribution}=={library.written_for})"
        )


# "library.patch" -> the patch, in the order applied
_applied: dict[str, "Patch"] = {}


class Patch:
    """A named change to another library (the decorated function), applied once per process after the guard."""

    def __init__(self, library: Library, change: Callable[..., None], targets: tuple[Target, ...]):
        functools.update_wrapper(self, change)
        self.library, self.change, self.targets = library, change, targets
        self.label = f"{library.name}.{change.__name__}"

    def check(self) -> None:
        """Refuse to start when a target of this patch is missing or changed."""
        for target in self.targets:
            target.require(f"flame.compat.{self.label}")

    def __call__(self, *args, **kwargs) -> None:
        if self.label in _applied:
            return
        self.check()
        self.change(*args, **kwargs)
        _applied[self.label] = self

    def __repr__(self) -> str:
        return f"<patch {self.label}>"


def patch(library: Library, *targets: Target) -> Callable[[Callable[..., None]], Patch]:
    """Decorator: the function becomes the ``Patch`` of ``library`` that changes ``targets``."""
    return lambda change: Patch(library, change, targets)


def applied() -> list[str]:
    """The patches applied in this process ("library.name"), in order."""
    return list(_applied)
