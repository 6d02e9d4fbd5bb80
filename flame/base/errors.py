"""The error types flame raises. A module of its own, importing nothing of flame's, so that
every module can raise them without importing the config machinery (no import cycles)."""

import math
import os
import traceback


class ConfigError(ValueError):
    """A job setting that cannot work. The message is one line: what is wrong and what to change.

    Raised before any process group, dataset or model exists wherever the check allows it;
    ``flame.train`` and ``flame.launch.preflight`` print it as ``flame: error: ...`` and exit with 2.
    """


class DataError(ConfigError):
    """A record of the data that cannot be trained on (e.g. an SFT record without an assistant turn): one
    line naming the source, the record and the fix. Raised before training for the records checked up
    front; for the others while training, by the rank that reads the record only."""


class UpdatesFailingError(RuntimeError):
    """A step's update cannot be taken and may not be skipped: a NaN/Inf gradient norm without
    --training.skip_nan_inf, or one skipped update (NaN/Inf or loss spike) more in a row than
    --training.max_skipped_steps allows. Raised on every rank alike; the run stops, exit 1."""


class SaveFailedError(RuntimeError):
    """A checkpoint save that could not be written where no later save can make up for it: the run's last step, the
    seed checkpoint. Raised on every rank alike (DCP tells every rank of a failed save); the run stops, exit 1,
    exporting nothing. Interval saves that fail are warnings instead (flame.checkpoint.save_failures)."""


def gist(error: BaseException) -> str:
    """A library error in a few words, for a one-line message: its innermost cause's first line.

    Errors whose text alone says nothing are put in words: a KeyError's text is the bare key, and an
    OSError's a bare errno number or "[Errno N] ..." (its words and file are kept, the number dropped)."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, KeyError) and len(error.args) == 1:
        key = error.args[0]
        if not (isinstance(key, str) and " " in key.strip()):  # a bare key (some libraries raise a sentence instead)
            return f"missing key {key!r} ({type(error).__name__})"
        error = RuntimeError(key)  # the sentence, without the quotes str() puts around a KeyError's argument
    if isinstance(error, OSError) and (number := _errno(error)) is not None:
        words = error.strerror or os.strerror(number)
        return f"{words}: {error.filename}" if error.filename else words
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(error).__name__


def _errno(error: OSError) -> int | None:
    """The error number of ``error``: its errno, or a lone number it was raised with (``OSError(28)``)."""
    if error.errno is not None:
        return error.errno
    return error.args[0] if len(error.args) == 1 and isinstance(error.args[0], int) else None


def check_number(flag: str, value: float, low: float, high: float = math.inf, *, high_open: bool = False,
                 meaning: str = "") -> None:
    """Refuse ``value`` unless finite and within [low, high] (or [low, high) with ``high_open``): the range check of
    every numeric setting, here so that the optimizer records (flame.optim) and flame.prepare share it."""
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or value < low or above:
        bound = f"at least {low:g}" if high == math.inf else f"in [{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{flag} must be a number {bound}{meaning}, got {value}")


def failure_line(error: BaseException, logs: str, rank: str) -> str:
    """One line for an unexpected error of rank ``rank``: what failed and where its traceback went.

    A rank's stderr is also the console's (train.sh tees it), so the traceback goes to a file of its own,
    <logs>/rank<rank>-traceback.txt, for the report of a bug; the console gets this line.
    """
    path = os.path.join(logs, f"rank{rank}-traceback.txt")
    try:
        os.makedirs(logs, exist_ok=True)
        with open(path, "w") as file:
            file.write("".join(traceback.format_exception(error)))
        where = f"its traceback is in {path}"
    except OSError as problem:  # nowhere to write it: the traceback on stderr, after all
        traceback.print_exception(error)
        where = f"its traceback is above ({path} could not be written: {problem.strerror})"
    return f"rank {rank} failed: {gist(error)} ({type(error).__name__}); {where}"
