"""Signal trials: a stop signal at a random step, then the same command again.

A trial sends one signal to a running job, as its sender would:
  group     to train.sh's whole process group: Ctrl-C in a terminal (SIGINT), Slurm's SIGTERM to a job step
  launcher  to train.sh's launcher only (flame.launch.supervise: torchrun's agent), which passes it on
at a seeded moment after the first logged step. The run must then end by itself with the status
128 + signal, no traceback on the console, a line naming the step it saved and the command that
resumes, and that step complete on disk: the last logged step, so that no step is lost. The same
command again must finish with every logged loss bit-identical to the uninterrupted reference.
"""

import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.runs import (
    POLL,
    Attempt,
    Reference,
    complete_steps,
    descendants,
    kill_all,
    leftovers,
    loss_differences,
    losses,
    metric_lines,
)

TARGETS = ("group", "launcher")
LAUNCHER = "flame.launch.supervise"


@dataclass
class SignalTrial:
    name: str
    procs: int
    signal: str
    target: str
    landed: bool = False  # False: the run ended before the moment came
    at_step: int = 0  # the last logged step when the signal went out
    status: int | None = None  # the signalled attempt's exit status
    saved: int | None = None  # the latest complete checkpoint step after it ended
    last_logged: int | None = None  # the last step the signalled attempt logged
    console_traceback: bool = False
    reported: bool = False  # the console named the saved step and the resume command
    resumed: bool = False
    identical: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def lost_steps(self) -> int:
        """Steps the signalled attempt took that no checkpoint kept."""
        return (self.last_logged or 0) - (self.saved or 0)

    @property
    def passed(self) -> bool:
        return (self.landed and self.status == 128 + getattr(signal, self.signal) and not self.console_traceback
                and self.reported and self.lost_steps == 0 and self.identical)


def launcher_pid(attempt: Attempt) -> int | None:
    """The launcher's pid: the ranks and their loader workers it forks share its command line, not its name."""
    for process in descendants(attempt.process.pid):
        try:
            name = Path(f"/proc/{process.pid}/comm").read_text().strip()
        except OSError:
            continue
        if LAUNCHER in process.command and not name.startswith(("flame-rank", "pt_")):
            return process.pid
    return None


def run_signal_trial(name: str, reference: Reference, sig: signal.Signals, target: str, work: Path,
                     rng: random.Random, keep: bool) -> SignalTrial:
    """One trial on a fresh dump folder: ``sig`` to ``target`` at a seeded step, then the same command to the end."""
    job = reference.job
    job = type(job)(work / name / "dump", job.procs, job.steps, job.interval, job.extra)
    trial = SignalTrial(name, job.procs, sig.name, target)
    # a step between the first and the one before last, so that the run is training when the signal lands
    goal = rng.randint(1, max(job.steps - 2, 1))
    attempt = Attempt(job, work / name / "attempt-1")
    while attempt.running():
        logged = sorted(losses(metric_lines(job.dump))[0])
        if logged and logged[-1] >= goal:
            trial.at_step = logged[-1]
            break
        time.sleep(POLL)
    if attempt.running():
        pid = attempt.process.pid if target == "group" else launcher_pid(attempt)
        try:
            if target == "group":
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            trial.landed = True
        except (ProcessLookupError, TypeError):
            trial.problems.append(f"no process to signal ({target})")
    trial.status = attempt.wait(4 * reference.duration + 120)
    if not trial.landed:
        trial.problems.append(f"the attempt ended before step {goal} (exit {trial.status})")
        return trial
    console = attempt.stdout + attempt.stderr
    trial.console_traceback = "Traceback" in console
    steps = complete_steps(job.checkpoints)
    trial.saved = steps[-1] if steps else None
    logged = sorted(losses(metric_lines(job.dump))[0])
    trial.last_logged = logged[-1] if logged else None
    trial.reported = (f"stopped by {sig.name}: step-{trial.saved} is saved" in console
                      and "resume with: bash train.sh" in console)
    if trial.status != 128 + sig:
        trial.problems.append(f"exit status {trial.status}, not {128 + sig}")
    if trial.lost_steps:
        trial.problems.append(f"{trial.lost_steps} step(s) lost: logged {trial.last_logged}, saved {trial.saved}")
    if not trial.reported:
        trial.problems.append("the console did not name the saved step and the resume command")
    if still := leftovers(job.dump, []):
        trial.problems.append(f"{len(still)} process(es) alive after the stop")
        kill_all(still)
    last = Attempt(job, work / name / "attempt-2")
    status = last.wait(4 * reference.duration + 120)
    trial.resumed = status == 0
    if not trial.resumed:
        trial.problems.append(f"the resume {'timed out' if status is None else f'failed (exit {status})'}")
    got, _ = losses(metric_lines(job.dump))
    differences = loss_differences(got, reference.losses)
    trial.identical = trial.resumed and not differences
    trial.problems += differences[:3]
    if not keep:
        shutil.rmtree(job.dump, ignore_errors=True)
    return trial
