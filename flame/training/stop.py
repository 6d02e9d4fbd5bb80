"""Stopping a run on a signal: every rank finishes its step, the run saves that step, and the ranks end cleanly.

Slurm sends SIGTERM before a requeue and at the time limit, torchrun's agent passes on what it gets
(train.sh's launcher makes it wait for the save: flame.compat.torchrun), and Ctrl-C sends SIGINT to
every process of the terminal. A handler that raised would abandon a half-taken step with a
traceback, so ``StopSignals`` only notes the signal; the trainer reads it in the step's first
collective, where all ranks agree to stop after the same step, then saves that step (in full and
synchronously, with its manifest) and writes ``STOPPED_FILE``, from which the launcher says what was
saved and how to resume (flame.base.run_record.take_stop_record). The same signal arriving twice (the terminal's and the agent's copy) is one
request; a second one at least ``REPEAT_S`` later ends the process at once, saving nothing more.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
from torchtitan.tools.logging import logger

from flame.base.process import STOP_SIGNALS
from flame.base.run_record import STOPPED_FILE

REPEAT_S = 2.0  # closer than this, a second signal is a copy of the first (the terminal's and the agent's)


class StopSignals:
    """The first stop signal this process received (``received``), noted by handlers installed in the main thread.

    One per process (``signals()``): a signal's handler belongs to the process, not to an object.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._first_at = 0.0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            self._first_at = time.monotonic()
        elif time.monotonic() - self._first_at >= REPEAT_S:
            # os.write, not print: a handler may interrupt a print of the main thread
            os.write(2, f"flame: a second {signal.Signals(signum).name}: this rank stops at once\n".encode())
            os._exit(128 + signum)


_SIGNALS = StopSignals()


def signals() -> StopSignals:
    """This process's stop signals (flame.train installs their handlers first; the Trainer reads them)."""
    return _SIGNALS


def save_the_stopped_step(checkpointer, step: int, first_step: int, received: signal.Signals | None,
                          dump_folder: str) -> None:
    """After the loop stopped on a signal (every rank): save ``step`` unless the loop's interval save just did, in full
    and synchronously, then (rank 0) record the stop for the launcher. ``received``: this rank's signal, if it got one."""
    taken = step >= first_step  # a signal while building stops before this attempt's first step
    # torchtitan's own test of an interval save, which the loop just made for this step
    saved_by_the_loop = taken and checkpointer.enable and checkpointer._should_save(step, last_step=False)
    if taken and checkpointer.enable and not saved_by_the_loop:
        # in full even under --checkpoint.last_save_model_only: the run resumes from this step
        model_only, checkpointer.last_save_model_only = checkpointer.last_save_model_only, False
        try:
            checkpointer.save(step, last_step=True)
        finally:
            checkpointer.last_save_model_only = model_only
    if checkpointer.recorder is not None:
        checkpointer.recorder.wait()  # the manifest that makes the step complete
    # a save that could not be written (flame.checkpoint.save_failures) says why
    failed = checkpointer.failures.failed.get(step) if taken and checkpointer.enable else None
    saved = taken and checkpointer.enable and failed is None
    what = received.name if received else "another rank's signal"
    logger.warning(f"Stopped by {what} after step {step}: "
                   + (f"step-{step} is saved" if saved else failed or "nothing new to save"))
    if torch.distributed.get_rank() == 0:
        try:
            with open(os.path.join(dump_folder, STOPPED_FILE), "w") as file:
                json.dump({"signal": what, "step": step, "saved": saved, **({"failed": failed} if failed else {})}, file)
        except OSError as error:  # the launcher then cannot say how the run stopped: the log says it
            logger.warning(f"{STOPPED_FILE} was not written ({error}); the run stopped after step {step}")
