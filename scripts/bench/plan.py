"""What a GPU-check suite is made of, and how it becomes the steps that run.

A suite (scripts/gpu_check.py: SUITES) lists ``Command``s and ``Run``s. ``setup`` items run
once; ``per_config`` items run for each of the suite's model configs, named ``<config>-<item>``
(configs/tiny/gla.json's tp2 run is ``gla-tp2``; just ``gla`` in a suite of one such item).
Their texts may hold placeholders: {config} (the config's path), {steps}, {half} (steps / 2:
the last half is the timed window), {tokens}, {quarter} (tokens / 4), {double} (tokens x 2),
{context} (gpu_check.CONTEXT, at most tokens / 4), {device} (cuda, or cpu with --cpu),
{python} (the driver's interpreter) and, in a command, {profile} (<work>/<step>.profile.txt: a
profiled step's summary, which the profiles report prints as it does a train.sh run's).
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

COMPILE_FLAG = "--training.compile"
BLOCK_LINES = 2


@dataclass(frozen=True)
class Command:
    """A command whose output is kept as a log; ``show`` picks the log lines the summary prints."""

    name: str
    argv: tuple[str, ...]
    show: str = ""  # regular expression; "" = the last line
    show_block: str = ""  # regular expression: a matching line and the BLOCK_LINES after it (e.g. a text sample)
    no_compile: tuple[str, ...] = ()  # arguments added under --no-compile (the command compiles otherwise)
    only: tuple[str, ...] = ()  # per-config items: only for these configs (file name without .json)
    compiled: bool = False  # a compiled-only measurement: left out under --no-compile
    on_request: bool = False  # runs only when --only names it (an extra the suite's time budget leaves out)
    gpus: int = 1  # GPUs it uses: skipped where fewer are visible, given its own under --spread


@dataclass(frozen=True)
class Run:
    """A `bash train.sh` run of the config on ``gpus`` GPUs: the suite's flags, then ``flags``."""

    name: str
    gpus: int
    flags: tuple[str, ...] = ()
    reference: str | None = None  # the item whose loss curve this run must repeat
    only: tuple[str, ...] = ()


@dataclass(frozen=True)
class Suite:
    """A named check: what it runs (setup, then per_config for each config) and how its summary reads."""

    about: str
    report: str  # how the summary shows it: lines, runs, zoo or throughput (scripts/bench/reports.py)
    setup: tuple[Command, ...] = ()
    per_config: tuple[Command | Run, ...] = ()
    configs: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()  # train.sh flags of every Run (and of the seed checkpoint)
    steps: int | None = None  # defaults of --steps and --tokens
    tokens: int | None = None
    timeout: int = 500  # seconds per step (--timeout)
    seeded: bool = False  # every Run of a config starts from one seed checkpoint of it
    parallel: bool = False  # per-config Commands share the GPU, --jobs at a time
    baseline: str | None = None  # runs table: tokens/s per GPU also as a share of this item's


@dataclass
class Step:
    """One process to start: a command, or a train.sh run (``train``) of ``config``.

    A train.sh run is `bash train.sh <common> --model.config <config> --job.dump_folder <its
    folder> [<seed checkpoint flags>] <argv>`; its seed checkpoint is made with ``common``.
    """

    suite: str
    item: str  # the Command's or Run's name (what --only selects)
    name: str  # unique within the suite: the log is <work>/<suite>/<name>.log
    argv: list[str]
    show: str = ""
    show_block: str = ""
    config: str | None = None
    gpus: int = 1
    train: bool = False
    common: list[str] = field(default_factory=list)
    seeded: bool = False
    reference: str | None = None


def stem(config: str) -> str:
    return Path(config).stem


def fill(texts, values: dict) -> list[str]:
    return [text.format(**values) for text in texts]


def steps_of(suite_name: str, suite: Suite, configs: list[str], values: dict, extra_flags: list[str],
             only: set[str], no_compile: bool) -> list[Step]:
    """The suite's steps, in order: setup, then every per-config item of each config in turn."""
    steps = []
    for command in suite.setup:
        if command.name in only or not only and not command.on_request:
            argv = fill(command.argv, values) + (list(command.no_compile) if no_compile else [])
            steps.append(Step(suite_name, command.name, command.name, argv, command.show, command.show_block))
    for config in configs:
        name = stem(config)
        here = {**values, "config": config}
        for item in suite.per_config:
            if (item.only and name not in item.only) or (only and item.name not in only):
                continue
            step_name = name if len(suite.per_config) == 1 else f"{name}-{item.name}"
            if isinstance(item, Command):
                if item.compiled and no_compile or item.on_request and item.name not in only:
                    continue
                profile = str(Path(values["work"]) / f"{step_name}.profile.txt")
                argv = fill(item.argv, {**here, "profile": profile}) + (list(item.no_compile) if no_compile else [])
                steps.append(Step(suite_name, item.name, step_name, argv, item.show, item.show_block, config, item.gpus))
                continue
            flags = fill(item.flags, here)
            if no_compile and COMPILE_FLAG in flags:
                continue
            reference = f"{name}-{item.reference}" if item.reference else None
            steps.append(Step(suite_name, item.name, step_name, flags, config=config, gpus=item.gpus, train=True,
                              common=fill(suite.flags, here) + extra_flags, seeded=suite.seeded, reference=reference))
    return steps


def rounds_of(steps: list[Step], rounds: int) -> list[Step]:
    """``rounds`` rounds of ``steps`` in their order, each step named <name>-run<k> (k from 1): the runs of an
    item are spread over the check, so a machine that drifts over time reaches every item alike."""
    if rounds == 1:
        return steps
    return [replace(step, name=f"{step.name}-run{k}") for k in range(1, rounds + 1) for step in steps]


def placeholders(suite: Suite) -> set[str]:
    """The placeholders the suite's texts use (which of --steps/--tokens mean something to it)."""
    texts = [*suite.flags]
    for item in (*suite.setup, *suite.per_config):
        texts += item.argv if isinstance(item, Command) else item.flags
    return {key for key in ("config", "steps", "half", "tokens", "quarter", "double", "context", "device", "python",
                            "profile")
            if any("{" + key + "}" in text for text in texts)}
