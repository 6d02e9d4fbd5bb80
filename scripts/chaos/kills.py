"""Kill trials: ``kill -9`` of train.sh's whole process group, then the same command again.

A trial is one dump folder: its first attempt and each resume may be killed (one or two kills
per trial), then a last resume runs to the end. A kill is one of
  mid-save    as soon as a checkpoint step folder the attempt writes has no .metadata yet
              (DCP writes it last), at a seeded choice among the saves still ahead
  mid-export  as soon as the HF export's staging folder (<dump>/.hf-*) appears
  random      at a seeded moment of the attempt's expected duration (start-up included)
What a kill really interrupted is read from the disk right after it (a random kill may land
mid-save too; a targeted one may come just late). A kill whose attempt ends before its moment
comes is missed, and tried again on the next attempt (MISSES attempts in all). The trial then checks what a user would:
nothing of the killed run still running, the job finishing, every logged loss bit-identical
to the uninterrupted reference, the HF export loading with the reference's weights, no
staging folder left.
"""

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.runs import (
    POLL,
    Attempt,
    Job,
    Process,
    Reference,
    complete_steps,
    export_problems,
    kill_all,
    leftovers,
    loss_differences,
    losses,
    metric_lines,
    orphans_after,
    staging_folders,
)

MID_SAVE, RANDOM, MID_EXPORT = "mid-save", "random", "mid-export"
# Each process count's kills cycle through this: a third mid-save, a sixth mid-export
PATTERN = (MID_SAVE, RANDOM, MID_EXPORT, MID_SAVE, RANDOM, RANDOM)
MISSES = 3  # attempts a planned kill gets: one that ends before the moment comes is followed by another


@dataclass
class Kill:
    planned: str
    landed: bool = False  # False: the attempt ended before the moment came
    where: str = ""  # what it interrupted, as read from the disk
    mid_save: bool = False
    mid_export: bool = False
    orphans: list[str] = field(default_factory=list)  # the killed run's processes that outlived it, and what they did


@dataclass
class Trial:
    procs: int
    name: str
    kills: list[Kill] = field(default_factory=list)
    resumed: bool = False  # the last attempt finished (exit 0)
    identical: bool = False  # every logged loss equal to the reference's, bit for bit
    export_ok: bool = False  # the HF export loads, with the reference's weights
    staging_left: list[str] = field(default_factory=list)  # export staging folders (.hf-*) left in the dump folder
    problems: list[str] = field(default_factory=list)

    @property
    def landed(self) -> list[Kill]:
        return [kill for kill in self.kills if kill.landed]


def plan(kills: int, procs: list[int], rng: random.Random) -> list[tuple[int, list[str]]]:
    """Trials as (process count, kinds of its kills in order): the kills shared round-robin among the
    process counts, each count's kinds cycling through PATTERN, grouped one or two per trial (mid-export last)."""
    trials = []
    for i, p in enumerate(procs):
        share = len(range(i, kills, len(procs)))  # kills i, i + len(procs), ... are this count's
        kinds = [PATTERN[j % len(PATTERN)] for j in range(share)]
        while kinds:
            take = min(rng.choice((1, 2)), len(kinds))
            group, kinds = kinds[:take], kinds[take:]
            trials.append((p, sorted(group, key=lambda kind: kind == MID_EXPORT)))
    return trials


def _fresh_saves(job: Job, since_ns: int) -> list[Path]:
    """Step folders with no .metadata that this attempt is writing (a file of theirs changed since it started)."""
    if not job.checkpoints.is_dir():
        return []
    found = []
    for folder in job.checkpoints.glob("step-*"):
        try:
            if not (folder / ".metadata").exists() and any(
                    entry.stat().st_mtime_ns >= since_ns for entry in folder.iterdir()):
                found.append(folder)
        except FileNotFoundError:  # deleted meanwhile (keep_latest_k)
            pass
    return found


def _kill_when(attempt: Attempt, kind: str, rng: random.Random, reference: Reference) -> tuple[Kill, list[Process]]:
    """Kill ``attempt`` at the moment ``kind`` names: what it interrupted, read right after, and the
    attempt's process tree just before the kill (none if the attempt ended first)."""
    job = attempt.job
    kill = Kill(kind)
    done = complete_steps(job.checkpoints)
    ahead = [s for s in job.save_steps if s > (done[-1] if done else 0)]
    staged_before = set(staging_folders(job.dump))
    if kind == MID_SAVE and not ahead:
        kind, kill.where = RANDOM, "(no save ahead: killed at random) "
    target = job.checkpoints / f"step-{rng.choice(ahead)}" if kind == MID_SAVE else None
    moment = rng.uniform(0.5, 0.9 * reference.expected_duration(done[-1] if done else 0))
    while attempt.running():
        if kind == MID_SAVE and target in _fresh_saves(job, attempt.started_ns):
            break
        if kind == MID_EXPORT and set(staging_folders(job.dump)) - staged_before:
            break
        if kind == RANDOM and attempt.elapsed >= moment:
            break
        time.sleep(POLL)
    else:
        kill.where += f"the attempt ended first (exit {attempt.process.returncode})"
        return kill, []
    at = attempt.elapsed
    tree = attempt.kill()
    kill.landed = True
    saving = sorted(p.name for p in _fresh_saves(job, attempt.started_ns))
    staged = sorted(set(staging_folders(job.dump)) - staged_before)
    kill.mid_save, kill.mid_export = bool(saving), bool(staged)
    steps = sorted(losses(metric_lines(job.dump))[0])
    state = [f"mid-save of {', '.join(saving)}"] if saving else []
    state += [f"mid-export ({', '.join(staged)})"] if staged else []
    if target is not None and not saving:
        state.append(f"just after the save of {target.name}")
    kill.where += f"at {at:.1f} s, last logged step {steps[-1] if steps else 'none'}"
    kill.where += f", {'; '.join(state)}" if state else ""
    return kill, tree


def run_trial(name: str, reference: Reference, kinds: list[str], work: Path, rng: random.Random,
              grace: float, keep: bool) -> Trial:
    """One trial on a fresh dump folder: attempts killed as ``kinds`` says, then resumed to the end."""
    job = Job(work / name / "dump", reference.job.procs, reference.job.steps, reference.job.interval,
              reference.job.extra)
    trial = Trial(job.procs, name)
    timeout = 4 * reference.duration + 120
    number = 0
    for kind in kinds:
        for _ in range(MISSES):
            number += 1
            attempt = Attempt(job, work / name / f"attempt-{number}")
            kill, tree = _kill_when(attempt, kind, rng, reference)
            trial.kills.append(kill)
            if kill.landed:
                break
            if attempt.process.returncode != 0:
                trial.problems.append(f"attempt {number} failed by itself: {_last_line(attempt.stderr)}")
        if not kill.landed:
            continue
        alive, wrote = orphans_after(job.dump, tree, grace)
        kill.orphans = [f"pid {p.pid} alive {grace:g} s after: {p.command[:100]}" for p in alive]
        kill.orphans += [f"the killed run went on writing: {change}" for change in wrote]
        kill_all(alive)  # so that the resume does not run beside them
    last = Attempt(job, work / name / f"attempt-{number + 1}")
    status = last.wait(timeout)
    trial.resumed = status == 0
    if not trial.resumed:
        trial.problems.append(f"the resume {'timed out' if status is None else f'failed (exit {status})'}: "
                              f"{_last_line(last.stderr)}")
    got, unreadable = losses(metric_lines(job.dump))
    differences = loss_differences(got, reference.losses)
    trial.identical = trial.resumed and not differences
    trial.problems += differences[:3] + ([f"... {len(differences) - 3} more"] if len(differences) > 3 else [])
    if unreadable:
        trial.problems.append(f"metrics.jsonl has {unreadable} unreadable line(s)")
    exported = export_problems(job.dump, reference.weights) if trial.resumed else ["no HF export"]
    trial.export_ok = not exported
    trial.problems += exported if trial.resumed else []
    trial.staging_left = staging_folders(job.dump)
    if trial.staging_left:
        trial.problems.append(f"export staging left: {', '.join(trial.staging_left)}")
    if still := leftovers(job.dump, []):
        trial.problems.append(f"{len(still)} process(es) still running after the last attempt")
        kill_all(still)
    if not keep:
        shutil.rmtree(job.dump, ignore_errors=True)
    return trial


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
