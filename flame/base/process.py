"""A process tied to the one that started it, and the names ranks go by (Linux; elsewhere neither).

train.sh's launcher (flame.launch.supervise) and every process it starts call ``die_with_parent`` first, so that
the run's processes end with train.sh however it ends; ``name_rank`` gives a rank the name ``pkill -USR2
'^flame-rank'`` finds.
"""

import ctypes
import faulthandler
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15
# A rank's process name (ps, pgrep, pkill without -f): forked ranks keep the launcher's command line,
# so this is what tells them from the launcher; data-loader workers rename themselves pt_data_worker.
RANK_NAME = "flame-rank"
PARENT_PID = "FLAME_PARENT_PID"  # set by a parent for its child: the pid the child must find as its parent
# The signals that stop a run with a checkpoint (flame.training.stop): Slurm's and torchrun's SIGTERM, Ctrl-C, a closed
# terminal, and SIGUSR1 (what Slurm's --signal sends by default). SIGUSR2 is the stack dump's (arrange_stack_dumps).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STACK_DUMP_SIGNAL = signal.SIGUSR2


def die_with_parent(sig: signal.Signals, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; elsewhere nothing).

    The parent may have exited already, before this ran: then this process has been handed to
    another parent, which ``parent`` (default: FLAME_PARENT_PID, the pid of the parent that
    started it) tells, and it takes ``sig`` now.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        print(f"flame: warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): "
              "this process will outlive its launcher", file=sys.stderr)
        return
    expected = str(parent) if parent is not None else os.environ.get(PARENT_PID, "")
    if expected.isdigit() and os.getppid() != int(expected):
        print(f"flame: the process that started this one (pid {expected}) has ended; stopping", file=sys.stderr)
        os.kill(os.getpid(), sig)
        sys.exit(128 + sig)  # a signal this process handles or ignores


def ignore_stop_signals() -> None:
    """For a rank's helper processes (data-loader workers): Ctrl-C reaches the whole terminal's process group, and a
    worker stopped by it would fail the step its rank finishes before saving; they end with their rank instead."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def ranks_of(parent: int) -> list[int]:
    """The rank processes ``parent`` started (Linux /proc; elsewhere none): its children named flame-rank*, or forked
    from it and not yet named (they share its command line), not its other helpers (multiprocessing's tracker)."""
    def read(pid: str, name: str) -> bytes:
        try:
            with open(f"/proc/{pid}/{name}", "rb") as file:
                return file.read()
        except OSError:
            return b""

    own_command = read(str(parent), "cmdline")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        stat = read(pid, "stat")
        fields = stat[stat.rfind(b")") + 2:].split()  # after "(comm)", which may hold spaces
        if len(fields) > 1 and int(fields[1]) == parent and (
                read(pid, "comm").startswith(RANK_NAME.encode()) or read(pid, "cmdline") == own_command):
            found.append(int(pid))
    return found


def name_rank(local_rank: str) -> None:
    """Name this process flame-rank<local rank> (Linux; elsewhere nothing): ``pkill -USR2 '^flame-rank'``."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, f"{RANK_NAME}{local_rank}".encode(), 0, 0, 0)


def arrange_stack_dumps() -> None:
    """Let a stuck rank show where it waits, in its stderr.log under <dump_folder>/logs.

    SIGUSR2 prints every thread's Python stack and training goes on (docs/running.md: "If a run seems
    stuck"). `FLAME_DUMP_STACKS_AFTER=<seconds> bash train.sh` prints them once, that long
    after train.sh started, from faulthandler's watchdog thread, which needs no signal: for
    machines where a signal reaches the data-loader workers but not the ranks' main processes.
    """
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    name_rank(os.environ.get("LOCAL_RANK", ""))  # answering SIGUSR2 now: what pkill -USR2 '^flame-rank' finds
    if at := os.environ.get("FLAME_DUMP_STACKS_AT"):  # train.sh: its start + FLAME_DUMP_STACKS_AFTER
        faulthandler.dump_traceback_later(max(float(at) - time.time(), 0.1))
