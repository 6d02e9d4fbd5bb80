"""Damaged checkpoints: a finished run's copy, its latest step damaged, resumed with the same command.

Cases (names for --damage):
  truncate-distcp    a .distcp file of the latest step cut to half its size
  garble-metadata    4 KiB of random bytes written over the middle of the latest step's .metadata
  delete-metadata    the latest step's .metadata removed
  delete-distcp      a .distcp file of the latest step removed
What a user should see: a message naming the damaged file (no traceback), the run going back
to the newest intact step, training the steps after it again and finishing with the losses of
the uninterrupted reference.
"""

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.runs import (
    Attempt,
    Job,
    Reference,
    complete_steps,
    export_problems,
    loss_differences,
    losses,
    metric_lines,
)


def _truncate(file: Path, rng: random.Random) -> None:
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)


def _garble(file: Path, rng: random.Random) -> None:
    size = file.stat().st_size
    span = min(4096, size)
    with open(file, "r+b") as f:
        f.seek((size - span) // 2)
        f.write(rng.randbytes(span))


def _delete(file: Path, rng: random.Random) -> None:
    file.unlink()


# case -> (which file of the step, what is done to it)
CASES = {
    "truncate-distcp": ("*.distcp", _truncate),
    "garble-metadata": (".metadata", _garble),
    "delete-metadata": (".metadata", _delete),
    "delete-distcp": ("*.distcp", _delete),
}


@dataclass
class Damage:
    case: str
    file: str = ""  # the damaged file, as step-N/name
    status: int | None = None  # the resume's exit status (None: timed out)
    named: bool = False  # a line of the resume's output names the step and the file
    traceback: bool = False  # the resume printed a Python traceback
    fell_back: bool = False  # the resume trained on from the previous complete step
    identical: bool = False  # finished with every loss equal to the reference's
    problems: list[str] = field(default_factory=list)

    @property
    def detected(self) -> bool:
        """Said which file, in a message of its own (a traceback naming it is a crash, not a check)."""
        return self.named and not self.traceback


def run_case(case: str, reference: Reference, work: Path, rng: random.Random, keep: bool) -> Damage:
    """Copy the reference's dump folder, damage its latest step as ``case`` says, resume, judge."""
    result = Damage(case)
    source = reference.job
    job = Job(work / case / "dump", source.procs, source.steps, source.interval, source.extra)
    shutil.copytree(source.dump, job.dump, ignore=shutil.ignore_patterns("logs"))
    steps = complete_steps(job.checkpoints)
    if len(steps) < 2:
        result.problems.append(f"the reference keeps {len(steps)} complete step(s): no previous step to fall back to")
        return result
    pattern, damage = CASES[case]
    step = job.checkpoints / f"step-{steps[-1]}"
    file = rng.choice(sorted(step.glob(pattern)))
    damage(file, rng)
    result.file = f"{step.name}/{file.name}"
    before = len(metric_lines(job.dump))

    attempt = Attempt(job, work / case / "resume")
    result.status = attempt.wait(4 * reference.duration + 120)
    output = attempt.stdout + attempt.stderr
    result.named = any(step.name in line and file.name in line for line in output.splitlines())
    result.traceback = "Traceback (most recent call last)" in output
    resumed_steps = sorted(losses(metric_lines(job.dump)[before:])[0])
    result.fell_back = result.status == 0 and bool(resumed_steps) and resumed_steps[0] == steps[-2] + 1
    if result.status != 0:
        lines = [line for line in attempt.stderr.splitlines() if line.strip()]
        result.problems.append(f"the resume {'timed out' if result.status is None else f'failed (exit {result.status})'}"
                               f": {lines[-1][:300] if lines else '(no output)'}")
    elif not resumed_steps:
        result.problems.append("the resume trained no step")
    elif not result.fell_back:
        result.problems.append(f"the resume trained steps {resumed_steps[0]}-{resumed_steps[-1]}, "
                               f"not from the previous complete step {steps[-2]}")
    got, unreadable = losses(metric_lines(job.dump))
    differences = loss_differences(got, reference.losses)
    result.identical = result.status == 0 and not differences and not unreadable
    result.problems += differences[:3]
    if result.status == 0:
        result.problems += export_problems(job.dump, reference.weights)
    if not keep:
        shutil.rmtree(job.dump, ignore_errors=True)
    return result
