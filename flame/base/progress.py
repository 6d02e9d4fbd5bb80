"""How far each rank got, so that the launcher can name the rank the others waited for when a run fails.

A rank that hangs (a stopped or frozen process, a data read that never returns) fails nothing itself: another
rank's collective times out and that rank reports the failure. Each rank keeps a note in a file of its own
(``PROGRESS_DIR``, which train.sh's launcher sets): the step it last started and a heartbeat time, written by a
thread every ``BEAT_S`` seconds (one ``pwrite``), which goes on while the main thread waits in a collective but
stops with a frozen process. After a failure the launcher reads the notes (``laggards``): a rank that never started
the step the others were in, or whose heartbeat stopped well before theirs, is named. A rank stuck inside a step
while its process runs (a GPU kernel that never ends) looks like the ranks waiting for it and is not named.
"""

import os
import threading
import time

PROGRESS_DIR = "FLAME_PROGRESS_DIR"  # set by train.sh's launcher for its ranks: <logs>/progress


BEAT_S = 2.0
STALE_S = 4 * BEAT_S  # a heartbeat this much older than the newest one stopped before the run failed


class StepNotes:
    """This rank's note: ``<step it last started> <heartbeat unix time>`` in <PROGRESS_DIR>/rank<rank>."""

    def __init__(self, rank: int):
        folder = os.environ.get(PROGRESS_DIR)
        self.step, self._fd = 0, None
        if not folder:
            return
        try:
            os.makedirs(folder, exist_ok=True)
            self._fd = os.open(os.path.join(folder, f"rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:  # a note helps a failure's report; it may not cost the run
            return
        threading.Thread(target=self._beat, name="flame-heartbeat", daemon=True).start()

    def starts(self, step: int) -> None:
        self.step = step
        self._write()

    def _beat(self) -> None:
        while True:
            self._write()
            time.sleep(BEAT_S)

    def _write(self) -> None:
        if self._fd is not None:
            try:
                os.pwrite(self._fd, f"{self.step:>12} {time.time():>18.3f}\n".encode(), 0)
            except OSError:
                pass


def read(folder: str) -> dict[int, tuple[int, float]]:
    """rank -> (the step it last started, when) from the notes in ``folder``."""
    notes = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if not name.startswith("rank") or not name[4:].isdigit():
            continue
        try:
            with open(os.path.join(folder, name)) as file:
                step, when = file.read().split()
            notes[int(name[4:])] = (int(step), float(when))
        except (OSError, ValueError):
            continue
    return notes


def laggards(folder: str, failed: int | None = None) -> str | None:
    """A phrase naming the ranks the others waited for (other than ``failed``, the rank reported as failing), or None
    when no rank stands out or there are no notes."""
    notes = read(folder)
    if len(notes) < 2:
        return None
    furthest = max(step for step, _ in notes.values())
    newest = max(when for _, when in notes.values())
    behind = sorted(rank for rank, (step, _) in notes.items() if step < furthest)
    frozen = sorted(rank for rank, (step, when) in notes.items() if step == furthest and newest - when > STALE_S)
    phrases = []
    if behind and behind != [failed]:
        steps = ", ".join(str(step) for step in sorted({notes[rank][0] for rank in behind}))
        phrases.append(f"{_ranks(behind)} never started step {furthest}, which the others had (last started: step "
                       f"{steps}): the others waited for {_them(behind)}")
    if frozen and frozen != [failed] and len(frozen) < len(notes):
        quiet = min(newest - notes[rank][1] for rank in frozen)
        phrases.append(f"{_ranks(frozen)} stopped answering {quiet:.0f} s before the others ended, inside step "
                       f"{furthest} (a frozen or stopped process): the others waited for {_them(frozen)}")
    return "; ".join(phrases) or None


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _them(ranks: list[int]) -> str:
    return "them" if len(ranks) > 1 else "it"


def clear(folder: str) -> None:
    """Remove the notes of an earlier attempt (the launcher, before it starts the ranks)."""
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith("rank"):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
