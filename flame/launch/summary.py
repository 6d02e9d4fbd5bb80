"""What the launcher tells the user when a run ends: how it went, where everything is, and what to type next.

Three endings, each a few lines on the console (the ranks' own logs hold the details):
- finished: the last step's loss (and validation loss), tokens, wall time, the checkpoint, the HF export, and
  the commands that evaluate, plot and publish it;
- stopped by a signal (flame.training.stop): the step saved and the command that resumes there;
- already complete: a rerun of a run whose last checkpoint is its last step trains nothing.
"""

from __future__ import annotations

import glob
import os
import shlex
import signal
import sys

from flame.base import progress, run_record
from flame.base.errors import ConfigError
from flame.checkpoint.steps import complete_steps


def tool() -> str:
    """How to call the ``flame`` command from here: by name when the run started with it, else this environment's
    script (a checkout's .venv has one without being activated), else ``python -m flame``."""
    if os.environ.get("FLAME_COMMAND", "").startswith("flame"):
        return "flame"
    script = os.path.join(os.path.dirname(sys.executable), "flame")
    if not os.path.exists(script):
        return f"{shlex.quote(sys.executable)} -m flame"
    relative = os.path.relpath(script)
    return shlex.quote(relative if not relative.startswith("..") else script)


def train_command(train_args: list[str]) -> str:
    """The command line that runs this job again (and so resumes it)."""
    return " ".join([os.environ.get("FLAME_COMMAND", "flame train"), *map(shlex.quote, train_args)])


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def finished(dump_folder: str, checkpoint_folder: str, seconds: float, export: str | None) -> str:
    """The lines of a run that trained to its end (``export``: the HF export's folder, if it made one)."""
    try:
        records = run_record.metrics(dump_folder)
    except (ConfigError, OSError):  # metrics.jsonl could not be written (a warning said so) or read: the rest stands
        records = {}
    steps = complete_steps(checkpoint_folder)
    last_step = max([*steps[-1:], *records], default=0)
    facts = []
    if records:
        logged = max(records)
        last = records[logged]
        if run_record.LOSS in last:
            facts.append(f"loss {last[run_record.LOSS]:.4f}" + (f" (logged at step {logged})" if logged != last_step else ""))
        validated = [s for s in records if run_record.VALIDATION_LOSS in records[s]]
        if validated:
            facts.append(f"validation loss {records[validated[-1]][run_record.VALIDATION_LOSS]:.4f} (step {validated[-1]})")
        tokens = run_record.tokens_at(records, last_step)
        if tokens:
            facts.append(f"{tokens / 1e6:,.1f}M tokens" if tokens >= 1e6 else f"{int(tokens):,} tokens")
    facts.append(f"this attempt {_duration(seconds)}")
    lines = [f"flame: done: step {last_step}, {', '.join(facts)}"]
    if steps:
        lines.append(f"  checkpoint: {os.path.join(checkpoint_folder, f'step-{steps[-1]}')}")
    if export:
        lines.append(f"  HF model:   {export}   (transformers' from_pretrained loads it)")
    lines.append(f"  curves:     {os.path.join(dump_folder, 'curves.png')}")
    flame = tool()
    model = export or dump_folder
    lines.append(f"  next:       {flame} eval --model {shlex.quote(model)} --tasks piqa,hellaswag")
    lines.append(f"              {flame} push {shlex.quote(dump_folder)} --repo_id <you>/<name> --dry_run")
    return "\n".join(lines)


def stopped(record: dict, train_args: list[str]) -> str:
    """The line of a run that a signal stopped after a step (``record``: flame.training.stop's)."""
    saved = (f"step-{record['step']} is saved and training resumes there" if record.get("saved")
             else f"{record['failed']}, where training resumes" if record.get("failed")  # its save could not be written
             else f"no checkpoint was saved after step {record['step']}")
    return f"flame: stopped by {record['signal']}: {saved}; resume with: {train_command(train_args)}"


def already_complete(step: int) -> str:
    return (f"flame: the run is already complete at step {step} (its last checkpoint); raise --training.steps "
            "to train further, or give a new --job.dump_folder for a new run")


def failed(failures: dict, logs: str) -> str:
    """The line of a run whose ranks failed (``failures``: torchrun's rank -> ProcessFailure): the first rank to fail,
    how, its own error line where its log has one, and where the logs are.

    A rank killed by a signal goes first: it noticed nothing, and its peers failed because it went (their
    connection to it broke), even when the agent saw them end within the same second.
    """
    rank, first = min(failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp, item[0]))
    if first.exitcode < 0:
        how = f"was killed by {signal.Signals(-first.exitcode).name}"
        if -first.exitcode == signal.SIGKILL:
            how += " (the host's out-of-memory killer, or a kill -9)"
    else:
        how = f"exited with status {first.exitcode}"
    said = _last_error_line(logs, first.local_rank)
    others = f"; {len(failures) - 1} other rank(s) stopped after it" if len(failures) > 1 else ""
    waited = progress.laggards(os.path.join(logs, "progress"), rank)  # a hung rank fails nothing itself: its peers time out
    waited = f"; {waited} (a hanging rank's Python stacks: pkill -USR2 '^flame-rank' while it hangs)" if waited else ""
    return (f"training failed: rank {rank} {how}{f': {said}' if said else ''}{others}{waited}; per-rank logs are in "
            f"{logs}")


def _last_error_line(logs: str, local_rank: int) -> str | None:
    """The last ``flame: error:`` line of a local rank's newest stderr.log under torchrun's log folder, without the prefix."""
    found = sorted(glob.glob(os.path.join(logs, "*", "attempt_*", str(local_rank), "stderr.log")), key=os.path.getmtime)
    if not found:
        return None
    try:
        with open(found[-1], errors="replace") as file:
            lines = [line.strip() for line in file if "flame: error:" in line]
    except OSError:
        return None
    return lines[-1].split("flame: error:", 1)[1].strip() if lines else None
