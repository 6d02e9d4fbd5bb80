"""A checkpoint save that cannot be written (a full disk, a quota, a folder made read-only) costs that save only.

DCP gathers every rank's outcome of a save and raises the same ``CheckpointException`` on all of
them, so every rank knows alike that step N was not saved, and can go on training together.
``SaveFailures`` (one per flame.checkpoint.manager.FlameCheckpointManager) turns such a failure
into what the user needs to know: which step was not saved and why (the rank, the error, the
file), that the partial files of a step folder this save made were removed (they are incomplete,
and would keep the disk full), and which checkpoint the run would resume from. An interval save
is a warning and training goes on, the next interval saving again; the steps that failed are kept
in ``failed``. The run's last save, a stop's save and the seed checkpoint have no next interval:
``check_the_last_save`` (the trainer's), flame.training.stop and flame.train say their failure in
one line.

Only failures of writing count: an error that is not an ``OSError`` on every failing rank, or an
``OSError`` of one process among several (which its peers, inside DCP's collectives, never saw),
still ends the run.
"""

import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.tools.logging import logger

from flame.base.errors import SaveFailedError, gist
from flame.checkpoint import manifest


def write_failure(error: BaseException, ranks: int) -> str | None:
    """What failed, in a few words ("rank 1: No space left on device: /x/__1_0.distcp"), when ``error`` is a
    failed write every rank of ``ranks`` saw alike; else None."""
    if isinstance(error, CheckpointException):
        failures = sorted((rank, wrapped[0]) for rank, wrapped in error.failures.items())
        if failures and all(isinstance(cause, OSError) for _, cause in failures):
            rank, cause = failures[0]
            return f"rank {rank}: {gist(cause)}" if ranks > 1 else gist(cause)
    elif isinstance(error, OSError) and ranks == 1:
        return gist(error)
    return None


class SaveFailures:
    """The failed saves of one run's checkpoints in ``folder`` (saved every ``interval`` steps), and what they mean."""

    def __init__(self, folder: str, interval: int, rank: int, ranks: int):
        self.folder, self.interval, self.rank, self.ranks = folder, interval, rank, ranks
        self.failed: dict[int, str] = {}  # step -> what the user is told of it
        self.last_step: int | None = None  # the run's last step (the trainer sets it): no interval save comes after
        self._made: dict[str, bool] = {}  # step folder -> whether the save in flight there made it
        # whether the save in progress failed inside DCP's save itself (the manager sets it); not the error: its
        # traceback would keep the training loop's frames, and the data loader's workers, alive
        self.writing_failed = False

    def starting(self, step_folder: str) -> None:
        """A save of ``step_folder`` begins (before anything of it is written)."""
        self._made[step_folder] = not os.path.exists(step_folder)

    def record(self, step: int, error: BaseException, *, interval_save: bool, background: bool = False) -> bool:
        """Note that the save of ``step`` failed with ``error``: False when that is no failure to write (the caller
        raises it again). An interval save's failure is a warning here; the others' callers say it."""
        what = write_failure(error, self.ranks)
        if what is None:
            return False
        step_folder = os.path.join(self.folder, f"step-{step}")
        removed = self._made.pop(step_folder, False) and os.path.isdir(step_folder)
        if removed and self.rank == 0:  # every rank is past its writes: DCP raised this on all of them at once
            shutil.rmtree(step_folder, ignore_errors=True)
        complete = manifest.complete_steps(self.folder)
        latest = f"the latest complete checkpoint is step-{complete[-1]}" if complete else "there is no complete checkpoint yet"
        how = ", in the background" if background else ""
        self.failed[step] = (f"checkpoint step-{step} was not saved ({what}{how})"
                             f"{'; its partial files were removed' if removed else ''}; {latest}")
        if interval_save and self.rank == 0:
            logger.warning(f"{self.failed[step]}; training goes on, and {self._next_save(step)} tries again")
        return True

    def _next_save(self, step: int) -> str:
        following = (step // self.interval + 1) * self.interval
        if self.last_step is not None and following >= self.last_step:
            return f"the last step's save (step {self.last_step})"
        return f"the save at step {following}"

    def check_the_last_save(self, step: int, recorder) -> None:
        """The run's last step ``step`` is saved whole, or SaveFailedError (every rank alike for a failed write; rank 0
        for a manifest that was not written, once ``recorder`` has recorded it)."""
        why = self.failed.get(step)
        if why is None and self.rank == 0:
            recorder.wait()
            if step not in manifest.complete_steps(self.folder):
                why = f"checkpoint step-{step} is incomplete: its manifest was not written (the warning above says why)"
        if why is not None:
            raise SaveFailedError(f"{why}; the run trained to step {step}, but that step is not saved, so nothing was "
                                  "exported: fix that, then run the same command again (it resumes from the latest "
                                  "complete checkpoint and trains the rest)")
