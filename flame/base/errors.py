"""The error types flame raises. A module of its own, importing nothing of flame's, so that
every module can raise them without importing the config machinery (no import cycles)."""

import math
import os
import re
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


def preview(value) -> str:
    """A record's value, short enough for a one-line message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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


def worker_message(error: BaseException) -> str:
    """The message of an error as its DataLoader worker raised it.

    torch re-raises a worker's error in the rank as the same type, its text "Caught X in DataLoader worker
    process N" followed by the worker's whole traceback; the original message is that traceback's last line.
    """
    text = str(error)
    if "in DataLoader worker process" not in text or "Original Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    return last.split(": ", 1)[1] if ": " in last else last


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
    return f"rank {rank} failed: {_what_failed(error)} ({type(error).__name__}); {where}"


_SOURCE_PLACE = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h):\d+\]\s*")  # "[/path/gloo/.../unbound_buffer.cc:78] " in C++ errors
# how gloo and NCCL report a peer whose process ended (killed, out of memory, its node or its launcher lost): gloo's
# "Read error [addr]:port: Connection reset by peer" / "Write error [...]: Broken pipe", NCCL's remote error
_PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|(?:Read|Write) error \[|remote process exited|ncclRemoteError")
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (is killed by signal: [^.]+|exited unexpectedly)")


def _what_failed(error: BaseException) -> str:
    """What an unexpected error of a rank means, in its words, with the remedy where one is known."""
    if "in DataLoader worker process" in str(error):
        return worker_message(error)
    words = _SOURCE_PLACE.sub("", gist(error))
    if died := _WORKER_DIED.search(str(error)):
        return (f"its data-loader worker (pid {died.group(1)}) {died.group(2).replace('is killed', 'was killed')}: a "
                "worker killed by SIGKILL was usually ended by the host's out-of-memory killer (give the run more host "
                "memory, or fewer --training.num_workers); run the same command again to resume from the last "
                "checkpoint")
    if _PEER_LOST.search(words):
        words = words.split(". This is typically caused")[0]  # gloo's advice that follows is the line below
        return (f"its connection to another rank broke ({words}): that rank's process ended. On one node the "
                "launcher's line names it; on several, the node whose train.sh failed first says why in its own "
                "output. Run the same command again on every node to resume from the last checkpoint")
    if "timed out" in words.lower() or "timeout" in type(error).__name__.lower():
        return (f"a collective timed out ({words}): a rank never joined it (the launcher's line names it where it can), "
                "or the step is slower than --comm.train_timeout_seconds allows")
    return words
