"""A measurement cached in a file per machine, taken by one process at a time (the memory plan's rates and probes)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Measured = TypeVar("Measured")
UNREADABLE = (OSError, ValueError, TypeError, KeyError)  # none yet, half of one, or one an older flame wrote


def measured_once(path: Path, read: Callable[[Path], Measured], measure: Callable[[], Measured]) -> Measured:
    """``read(path)``, else ``measure()`` written to ``path`` first.

    Under a lock on the file: the processes of a node that need it at once (the ranks) wait for the
    first one's measurement and read it, instead of measuring side by side.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return read(path)
        except UNREADABLE:
            pass
        return write(path, measure())


def write(path: Path, measured: Measured) -> Measured:
    """Write a dataclass ``measured`` to ``path`` whole (a reader never sees half of it); returns it."""
    staging = path.with_suffix(".partial")
    staging.write_text(json.dumps(dataclasses.asdict(measured), indent=1))
    staging.replace(path)
    return measured
