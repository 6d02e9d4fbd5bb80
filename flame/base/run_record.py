"""What a run left in its dump folder, read back: its metrics per step, eval scores, the command.

The model card (flame.checkpoint.model_card) and the curves (flame.tools.plot) read runs through these.
Standard library only: the launcher draws the curves, and must not wait for torch.
"""

import glob
import json
import math
import os
import re
import shlex
from typing import Any

from flame.base.dump_folder import ATTEMPTS
from flame.base.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
# a stop on a signal (flame.training.stop), until the launcher reads it: {"signal": "SIGTERM", "step": 120, "saved": true}
STOPPED_FILE = "stopped.json"
COMMAND_FILE = "command.txt"  # in attempts/<n>/: the train.sh command line of that attempt (flame.launch.supervise)
LOSS = "loss_metrics/global_avg_loss"
TOKENS = "n_tokens_seen"
VALIDATION_LOSS, VALIDATION_BPB = "validation/loss", "validation/bpb"


def metrics(dump_folder: str) -> dict[int, dict[str, Any]]:
    """step -> what the run logged at that step (<dump_folder>/metrics.jsonl), steps in order.

    A resumed run logs again the steps after its checkpoint, and each line names its attempt:
    a step's records are merged in attempt order (within one attempt, in file order), so the
    latest attempt's values win and keys only an earlier record has (a score added later by
    another program, say) are kept. A line cut short by a kill is skipped.
    """
    path = os.path.join(dump_folder, METRICS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(
            f"{dump_folder} has no {METRICS_FILE}: give the dump folder of a run that logged at least one step "
            "(its --job.dump_folder)"
        )
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    rows.sort(key=lambda row: row.get("attempt") or 0)  # stable: file order within an attempt
    merged: dict[int, dict[str, Any]] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return dict(sorted(merged.items()))


def append_metrics(dump_folder: str, row: dict[str, Any]) -> None:
    """Append ``row`` to <dump_folder>/metrics.jsonl as one line, in one write to a file opened for appending.

    The trainer and evaluations running beside it (flame.eval) append to the same file: the
    kernel appends each whole write at the end of the file, so lines never interleave.
    """
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(os.path.join(dump_folder, METRICS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        while data:  # a regular file takes a write whole; a short one would go on at the end
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def series(records: dict[int, dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it was logged as a finite number."""
    points = [(step, row[key]) for step, row in records.items()
              if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
    return [step for step, _ in points], [float(value) for _, value in points]


def last(records: dict[int, dict[str, Any]], key: str, step: int | None = None) -> tuple[int, float] | None:
    """(step, value) of the last record of ``key`` at or before ``step`` (default: the last step), or None."""
    steps, values = series(records, key)
    found = [(s, v) for s, v in zip(steps, values) if step is None or s <= step]
    return found[-1] if found else None


def tokens_at(records: dict[int, dict[str, Any]], step: int) -> float | None:
    """Tokens trained by ``step``: as logged there, else from the nearest logged step before it
    (packed rows carry no padding, so every step trains the same number of tokens)."""
    found = last(records, TOKENS, step)
    if found is None:
        steps, values = series(records, TOKENS)
        found = (steps[0], values[0]) if steps else None
    if found is None or found[0] == 0:
        return None
    return found[1] if found[0] == step else found[1] * step / found[0]


_SCORE_FILTER = re.compile(r",none$")


def results_scores(results: Any) -> dict[str, float]:
    """{"task/metric": score} of the "results" of an lm-eval results file, standard errors and counts left out
    ("acc,none" -> "acc": the default filter goes unnamed)."""
    scores = {}
    for task, values in (results.items() if isinstance(results, dict) else ()):
        for metric, value in (values.items() if isinstance(values, dict) else ()):
            if (isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in metric
                    and metric != "sample_len"):  # how many examples were scored, not a score
                scores[f"{task}/{_SCORE_FILTER.sub('', metric).replace(',', ' ')}"] = float(value)
    return scores


def eval_scores(dump_folder: str, records: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, float]]:
    """step -> {"task/metric": score}: lm-eval's results files under <dump_folder>/eval/step-N/ (any depth),
    else the metrics.jsonl keys under ``eval/`` (the same scores, logged at their step). Standard errors left out."""
    scores: dict[int, dict[str, float]] = {}
    for folder in glob.glob(os.path.join(glob.escape(dump_folder), "eval", "step-*")):
        match = re.fullmatch(r"step-(\d+)", os.path.basename(folder))
        if not match:
            continue
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.json"), recursive=True),
                           key=os.path.getmtime):  # a later file's scores win
            try:
                with open(path) as f:
                    results = json.load(f).get("results")
            except (OSError, ValueError, AttributeError):
                continue
            if found := results_scores(results):
                scores.setdefault(int(match[1]), {}).update(found)
    for step, row in (records or {}).items():
        if step not in scores:
            logged = {key[5:]: float(v) for key, v in row.items() if key.startswith("eval/")
                      and isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in key}
            if logged:
                scores[step] = logged
    return dict(sorted(scores.items()))


def latest_attempt(dump_folder: str) -> int | None:
    """The number of the latest attempt that started in the dump folder (its job config is job_config.json)."""
    try:
        numbers = [int(name) for name in os.listdir(os.path.join(dump_folder, ATTEMPTS)) if name.isdigit()]
    except OSError:
        return None
    return max(numbers, default=None)


def record_command(dump_folder: str, attempt: int, torchrun_args: list[str]) -> None:
    """Write the train.sh command line of ``attempt`` (from its torchrun arguments), once that attempt has started."""
    folder = os.path.join(dump_folder, ATTEMPTS, str(attempt))
    if not os.path.isdir(folder) or "flame.train" not in torchrun_args:  # it never started, or is not flame's
        return
    options = dict(zip(torchrun_args, torchrun_args[1:]))
    env = [f"NGPU={options['--nproc_per_node']}"] if "--nproc_per_node" in options else []
    if options.get("--nnodes", "1") != "1":
        env.append(f"NNODE={options['--nnodes']}")
    flags = torchrun_args[torchrun_args.index("flame.train") + 1:]
    with open(os.path.join(folder, COMMAND_FILE), "w") as f:
        f.write(" ".join([*env, "bash", "train.sh", *map(shlex.quote, flags)]) + "\n")


def command(dump_folder: str) -> str | None:
    """The train.sh command line of the latest attempt, when train.sh launched it."""
    attempt = latest_attempt(dump_folder)
    path = os.path.join(dump_folder, ATTEMPTS, str(attempt), COMMAND_FILE)
    if attempt is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def take_stop_record(dump_folder: str) -> dict | None:
    """The record of a stop of the attempt that just ended (removed as it is read), or None when it did not stop."""
    path = os.path.join(dump_folder, STOPPED_FILE)
    try:
        with open(path) as file:
            record = json.load(file)
    except (OSError, ValueError):
        return None
    os.remove(path)
    return record
