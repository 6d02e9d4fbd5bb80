"""Two runs of one job started together on one dump folder.

What a user should see: exactly one runs, to the end, with the reference's losses logged once
per step and an HF export of the reference's weights; the other stops at once, in one line
(``flame: error: ...``), and changes nothing.
"""

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.runs import (
    Attempt,
    Job,
    Reference,
    export_problems,
    kill_all,
    leftovers,
    loss_differences,
    losses,
    metric_lines,
)


@dataclass
class TwoRuns:
    statuses: tuple = ()  # exit statuses of the two (None: timed out)
    one_ran: bool = False  # exactly one exited 0
    refused: str = ""  # the other's output, when it is one "flame: error:" line
    intact: bool = False  # the winner's metrics and export are those of one uninterrupted run
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.one_ran and bool(self.refused) and self.intact


def run_two(reference: Reference, work: Path, keep: bool) -> TwoRuns:
    source = reference.job
    job = Job(work / "two-runs" / "dump", source.procs, source.steps, source.interval, source.extra)
    attempts = [Attempt(job, work / "two-runs" / name) for name in ("first", "second")]
    timeout = 4 * reference.duration + 120
    result = TwoRuns(statuses=tuple(attempt.wait(timeout) for attempt in attempts))
    if still := leftovers(job.dump, []):
        result.problems.append(f"{len(still)} process(es) still running after both ended")
        kill_all(still)
    winners = [a for a, status in zip(attempts, result.statuses) if status == 0]
    result.one_ran = len(winners) == 1
    if not result.one_ran:
        result.problems.append(f"{len(winners)} of the two runs finished (exit statuses {result.statuses})")
    else:
        loser = attempts[1 - attempts.index(winners[0])]
        lines = [line for line in (loser.stdout + loser.stderr).splitlines() if line.strip()]
        if len(lines) == 1 and lines[0].startswith("flame: error:"):
            result.refused = lines[0]
        else:
            result.problems.append(f"the other run's output is {len(lines)} lines, ending: {lines[-1][:300] if lines else ''}")
    lines = metric_lines(job.dump)
    got, unreadable = losses(lines)
    counts = Counter(step for line in lines for step in losses([line])[0])
    twice = sorted(step for step, n in counts.items() if n > 1)
    differences = loss_differences(got, reference.losses)
    if unreadable or twice:
        result.problems.append(f"metrics.jsonl: {unreadable} unreadable line(s), {len(twice)} step(s) logged more than once")
    result.problems += differences[:3]
    exported = export_problems(job.dump, reference.weights) if winners else ["no run finished"]
    result.problems += exported
    result.intact = bool(winners) and not (unreadable or twice or differences or exported)
    if not keep:
        shutil.rmtree(job.dump, ignore_errors=True)
    return result
