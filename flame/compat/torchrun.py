"""torchrun's seam (torch.distributed.elastic): how train.sh's launcher, which runs torchrun's agent in its own
process, answers a stop signal.

Written for torch 2.11-2.13 (3rdparty/requirements.txt); the guard checks the handler's shape.
"""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Callable

from flame.compat.guard import Library, Target, patch

TORCH = Library("torch", "torch", "2.13.0")
_HANDLER = Target(TORCH, "torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler",
                  ("signum", "frame"))


@patch(TORCH, _HANDLER)
def first_signal_waits_for_the_save(on_first: Callable[[signal.Signals], None], ranks_alive: Callable[[], bool]) -> None:
    """Let the ranks save before they stop: the agent's first SIGTERM/SIGINT/SIGHUP waits, a second one kills.

    Upstream: the agent's handler raises ``SignalException``; the agent then sends the signal on to
    every rank and kills what is left 30 s later, whatever the ranks are doing.
    flame: the first signal is passed on to the ranks (``on_first`` does: it knows them), which finish
    their step, save it and exit on their own (flame.training.stop), while the agent keeps watching
    them as in a normal run. A second signal raises as upstream does, with SIGKILL for the ranks: the
    user asked twice, so nothing more is saved; once the ranks have ended (the agent is closing down
    after they saved), a second signal changes nothing and is ignored. The agent registers its handler when it starts the
    ranks, reading the module's function at that moment: this replaces that function.
    """
    api = importlib.import_module(_HANDLER.module)
    first: list[signal.Signals] = []

    def handler(signum: int, frame) -> None:
        if not first:
            first.append(signal.Signals(signum))
            on_first(first[0])
            return
        if not ranks_alive():  # they stopped on the first one: the run ends as it would have
            return
        raise api.SignalException(f"a second stop signal ({signal.Signals(signum).name}) in process {os.getpid()}",
                                  sigval=signal.SIGKILL)

    api._terminate_process_handler = handler
