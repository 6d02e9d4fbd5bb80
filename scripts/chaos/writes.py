"""Writes that fail: a full disk at a checkpoint save, at the last save, under metrics.jsonl; blocked output folders.

Cases (names for --writes):
  full-disk-at-a-save       the first interval save fails with ENOSPC on the last rank, after part of its file
  full-disk-at-the-last-save  the last step's save fails so; then the same command again, the disk freed
  metrics-on-a-full-disk    metrics.jsonl is /dev/full (every write: ENOSPC)
  output-folders-blocked    files stand where the TensorBoard and flight-recorder folders go (--metrics.enable_tensorboard)
What a user should see: a failed interval save, metrics or TensorBoard costs itself only (one warning
naming the step or file and the error; the run finishes exit 0 with the reference's losses and export,
no partial step folder left); a failed last save ends the run non-zero with a "flame: error:" line
naming the step, exports nothing, and the same command then finishes the run with the reference's
losses and export. Each case runs once per process count (the injected save fails on the last rank). The save failures are injected by a ``sitecustomize`` on PYTHONPATH that makes DCP's
FileSystemWriter raise ENOSPC for the steps in FLAME_CHAOS_FAILED_SAVES (a real full disk would fill
every other file too); the other cases are real.
"""

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

CASES = ("full-disk-at-a-save", "full-disk-at-the-last-save", "metrics-on-a-full-disk", "output-folders-blocked")

SITECUSTOMIZE = '''\
"""scripts/chaos/writes.py's fault: DCP's writes of the steps in FLAME_CHAOS_FAILED_SAVES fail as on a full disk."""
import os

if os.environ.get("FLAME_CHAOS_FAILED_SAVES"):
    import errno

    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    _failed = {int(step) for step in os.environ["FLAME_CHAOS_FAILED_SAVES"].split(",")}
    _write_data = FileSystemWriter.write_data

    def _full_disk(self, plan, planner):
        rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        step = os.path.basename(os.fspath(self.path)).removeprefix("step-")
        if step.isdigit() and int(step) in _failed and rank == ranks - 1:
            path = os.path.join(os.fspath(self.path), f"__{rank}_0.distcp")
            with open(path, "wb") as file:
                file.write(b"the first bytes of a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return _write_data(self, plan, planner)

    FileSystemWriter.write_data = _full_disk
'''


@dataclass
class FaultyJob(Job):
    """A job whose processes see ``env`` added to theirs."""

    faults: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = super().env()
        if "PYTHONPATH" in self.faults:  # after train.sh's checkout: the fault's sitecustomize is the only one
            env["PYTHONPATH"] = ":".join(filter(None, [env.get("PYTHONPATH"), self.faults["PYTHONPATH"]]))
        return env | {key: value for key, value in self.faults.items() if key != "PYTHONPATH"}


@dataclass
class Writes:
    case: str
    status: int | None = None  # the (first) attempt's exit status; None: timed out
    said: bool = False  # the console names what was not written, and why, in a line of its own
    traceback: bool = False  # the console shows a Python traceback
    identical: bool = False  # the finished run's losses (or, without metrics, its export) are the reference's
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.said and not self.traceback and self.identical and not self.problems


def fault_env(work: Path, steps: list[int]) -> dict[str, str]:
    """The environment that makes the saves of ``steps`` fail (its sitecustomize written into ``work``); PYTHONPATH is
    the sitecustomize's folder alone: add it after what a process needs on its path."""
    folder = work / "sitecustomize"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": str(folder), "FLAME_CHAOS_FAILED_SAVES": ",".join(map(str, steps))}


def run_case(case: str, reference: Reference, work: Path, keep: bool) -> Writes:
    """Run the reference's job with ``case``'s failing writes; judge what the console said and what the run left."""
    result = Writes(case)
    source = reference.job
    saves = source.save_steps
    faults, flags = {}, []
    if case == "full-disk-at-a-save":
        faults = fault_env(work / case, [saves[0]])
    elif case == "full-disk-at-the-last-save":
        faults = fault_env(work / case, [saves[-1]])
    elif case == "output-folders-blocked":
        flags = ["--metrics.enable_tensorboard"]
    job = FaultyJob(work / case / "dump", source.procs, source.steps, source.interval, source.extra + flags, faults)
    job.dump.mkdir(parents=True)
    if case == "metrics-on-a-full-disk":
        (job.dump / "metrics.jsonl").symlink_to("/dev/full")
    elif case == "output-folders-blocked":
        (job.dump / "tb").write_text("a file where TensorBoard's folder goes")
        (job.dump / "comm_traces").write_text("a file where the flight recorder's folder goes")

    attempt = Attempt(job, work / case / "run")
    result.status = attempt.wait(4 * reference.duration + 120)
    output = attempt.stdout + attempt.stderr
    result.traceback = "Traceback (most recent call last)" in output
    lines = output.splitlines()
    if case == "full-disk-at-a-save":
        result.said = any(f"checkpoint step-{saves[0]} was not saved" in line and "No space left on device" in line
                          and "tries again" in line for line in lines)
        if (job.checkpoints / f"step-{saves[0]}").exists():
            result.problems.append(f"the failed save's folder step-{saves[0]} was left")
        if complete_steps(job.checkpoints) != saves[1:]:
            result.problems.append(f"complete steps {complete_steps(job.checkpoints)}, expected {saves[1:]}")
    elif case == "full-disk-at-the-last-save":
        said = [line for line in attempt.stderr.splitlines() if "flame: error: " in line]  # a rank's, maybe prefixed
        result.said = any(f"checkpoint step-{saves[-1]} was not saved" in line and "No space left on device" in line
                          for line in said)
        if result.status in (0, None):
            result.problems.append(f"a run whose last save failed ended with exit {result.status}")
        if (job.dump / "hf").exists():
            result.problems.append("a run whose last save failed exported")
        job.faults = {}  # the disk freed: the same command again finishes the run
        again = Attempt(job, work / case / "again")
        status = again.wait(4 * reference.duration + 120)
        if status != 0:
            result.problems.append(f"the run again failed (exit {status}): {(again.stderr.strip().splitlines() or [''])[-1]}")
        result.status = status
    elif case == "metrics-on-a-full-disk":
        result.said = any("metrics.jsonl" in line and "No space left on device" in line for line in lines)
    else:
        result.said = (any("TensorBoard/W&B: the folder" in line and "cannot be made" in line for line in lines)
                       and any("communication traces: the folder" in line and "cannot be made" in line for line in lines))
    if result.status != 0:
        result.problems.append(f"exit {result.status}: {(attempt.stderr.strip().splitlines() or [''])[-1][:300]}")
    if case == "metrics-on-a-full-disk":  # no losses were logged: the export shows the run trained as the reference
        result.problems += export_problems(job.dump, reference.weights) if result.status == 0 else []
        result.identical = result.status == 0 and not result.problems
    else:
        got, unreadable = losses(metric_lines(job.dump))
        differences = loss_differences(got, reference.losses)
        result.problems += differences[:3] + (export_problems(job.dump, reference.weights) if result.status == 0 else [])
        result.identical = result.status == 0 and not differences and not unreadable
    if not keep:
        shutil.rmtree(job.dump, ignore_errors=True)
    return result
