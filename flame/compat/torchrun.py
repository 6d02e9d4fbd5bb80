"""torchrun's seam (torch.distributed.elastic): how train.sh's launcher, which runs torchrun's agent in its own
process, answers a stop signal.

Written for torch 2.11-2.13 (3rdparty/requirements.txt); the guard checks the handler's shape.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
from collections.abc import Callable

from flame.compat.guard import Library, Target, patch

TORCH = Library("torch", "torch", "2.13.0")
_HANDLER = Target(TORCH, "torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler",
                  ("signum", "frame"))
_POLL = Target(TORCH, "torch.distributed.elastic.multiprocessing.api", "MultiprocessContext._poll", ("self",))
_JOIN = Target(TORCH, "torch.multiprocessing.spawn", "ProcessContext.join", ("self", "timeout", "grace_period"))
# seconds the other ranks of a failed run get to end on their own, then again after SIGTERM, before SIGKILL
FAILED_RUN_GRACE = 5.0


@patch(TORCH, _HANDLER)
def first_signal_waits_for_the_save(on_first: Callable[[signal.Signals], None], ranks_alive: Callable[[], bool]) -> None:
    """Let the ranks save before they stop: the agent's first stop signal waits, a second one kills.

    Upstream: the agent's handler raises ``SignalException``; the agent then sends the signal on to
    every rank and kills what is left 30 s later, whatever the ranks are doing.
    flame: the first signal is passed on to the ranks (``on_first`` does: it knows them), which finish
    their step, save it and exit on their own (flame.training.stop), while the agent keeps watching
    them as in a normal run. A second signal raises as upstream does, with SIGKILL for the ranks: the
    user asked twice, so nothing more is saved; once the ranks have ended (the agent is closing down
    after they saved), a second signal changes nothing and is ignored. The agent registers its handler when it starts the
    ranks, reading the module's function at that moment: this replaces that function. Upstream leaves SIGUSR1
    (Slurm's --signal default) to end the agent and, with it, the ranks unsaved: here it is one more stop signal.
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
    signal.signal(signal.SIGUSR1, handler)


class _WithoutTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = None  # the record's own line stays
        return True


@patch(TORCH)
def failures_without_tracebacks() -> None:
    """The agent's report of a failed rank in its one line, without the agent's own traceback.

    Upstream: the agent logs "failed (exitcode: N) local_rank: R ..." with the traceback of its wait
    for the ranks (ProcessExitedException), which says nothing about why the rank failed. flame: the
    rank printed its own error line (its traceback in <dump_folder>/logs), and the launcher names the
    first rank that failed and how (flame.launch.summary.failed); the agent's line stays, its
    traceback goes.
    """
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_WithoutTraceback())


@patch(TORCH, _POLL)
def every_ended_rank_reported() -> None:
    """Report every rank that had ended with an error when the agent noticed the first, not only one of them.

    Upstream: the agent's poll reports one failed rank, the first its wait lists among those that had
    ended, then terminates the rest. When a rank is killed (the out-of-memory killer), its peers fail a
    moment later on the broken connection, and one poll may find both ended: which of them it reports
    is then a matter of order. flame: the ranks that had already ended with an error when the poll
    began are added to the report (the one upstream names stays), so the launcher can name the rank
    that went first (flame.launch.summary.failed); ranks the agent terminates afterwards are not
    failures of their own and stay out.
    """
    api = importlib.import_module(_POLL.module)
    upstream = api.MultiprocessContext._poll

    def poll(self):
        processes = list(self._pc.processes) if self._pc is not None else []
        ended = {rank: (process.pid, process.exitcode) for rank, process in enumerate(processes)
                 if process.exitcode not in (None, 0)}  # exitcode polls without waiting
        result = upstream(self)
        if result is not None and result.failures:
            for rank, (pid, exitcode) in ended.items():
                if rank not in result.failures:
                    result.failures[rank] = api.ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode,
                                                               error_file=self.error_files[rank])
        return result

    api.MultiprocessContext._poll = poll


@patch(TORCH, _JOIN)
def failed_runs_end_sooner() -> None:
    """Once a rank has failed, the others get a few seconds to end, not half a minute.

    Upstream: when one forked rank fails, the agent's wait sends SIGTERM to the others at once and
    kills them 30 s later. A rank hung in a collective (its peer gone) or in C code runs no signal
    handler, so every such failure reached the console half a minute late. flame: the others get
    ``FAILED_RUN_GRACE`` seconds to end on their own (a peer that lost its connection fails by itself,
    with its own line), then SIGTERM and as long again, then SIGKILL. Nothing of a failed run is
    saved meanwhile: its collectives cannot complete. A stop signal is not a failure: the ranks
    save and end on their own (``first_signal_waits_for_the_save``), and this wait is never reached.
    """
    spawn = importlib.import_module(_JOIN.module)
    upstream = spawn.ProcessContext.join

    def join(self, timeout=None, grace_period=None):
        return upstream(self, timeout, FAILED_RUN_GRACE if grace_period is None else grace_period)

    spawn.ProcessContext.join = join
