"""train.sh's launcher on each node: torchrun's agent, living exactly as long as train.sh and the run.

    FLAME_PARENT_PID=$$ python -m flame.supervise --dump-folder exp/run --node-rank 0 [--export-hf] \\
        -- <torchrun arguments>

torchrun starts every rank in a session of its own, so killing train.sh (even its whole process
group, with ``kill -9``) would leave the ranks training on, beside any run started next. This
process ties the run's processes to train.sh:

- it asks the kernel for SIGTERM when train.sh (its parent) exits: torchrun's own handler then
  stops the ranks; it runs torchrun's agent in this very process (torch.distributed.run.main);
- every rank asks for SIGKILL when the agent exits (flame.train calls ``die_with_parent`` before
  anything else), which covers an agent killed outright;
- on node 0 it holds the dump folder's lock for the run's life (flame.dump_folder), the HF
  export after training included (--export-hf), and picks the attempt number, passed to the
  ranks as FLAME_ATTEMPT; after training it records the attempt's command line and draws
  <dump_folder>/curves.png (flame.plot). Other nodes neither lock, number nor draw.

Linux only (prctl PR_SET_PDEATHSIG); elsewhere the processes run untied, as under bare torchrun.
"""

import argparse
import ctypes
import os
import shlex
import signal
import sys
import traceback

from flame.dump_folder import DumpFolderLock
from flame.errors import ConfigError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_PID = "FLAME_PARENT_PID"  # set by a parent for its child: the pid the child must find as its parent


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


def train(torchrun_args: list[str]) -> int:
    """Run torchrun's agent in this process: 0 when every rank finished, else 1 (after torchrun's report)."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run.main(torchrun_args)
    except Exception as error:  # a rank failed (torchrun's ChildFailedError names it), or a signal stopped the agent
        traceback.print_exc()
        logs = torchrun_args[torchrun_args.index("--log-dir") + 1] if "--log-dir" in torchrun_args else "torchrun's log folder"
        what = f"stopped by {signal.Signals(error.sigval).name}" if isinstance(error, SignalException) else "failed"
        print(f"flame: training {what}; per-rank logs are in {logs}", file=sys.stderr)
        return 1
    return 0


def record_the_run(dump_folder: str, attempt: int, torchrun_args: list[str]) -> None:
    """After training: the attempt's train.sh command line (for the model card) and <dump_folder>/curves.png.

    Neither may fail the run or its export: a problem is a warning.
    """
    try:
        from flame import plot, run_record

        run_record.record_command(dump_folder, attempt, torchrun_args)
        if curves := plot.write_run_curves(dump_folder):
            print(f"flame: the run's curves are in {curves}")
    except Exception as error:
        print(f"flame: warning: the run's command line or curves were not recorded ({type(error).__name__}: {error}); "
              f"training and the export are unaffected; draw the curves with: python -m flame.plot {dump_folder}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)  # first: train.sh may be killed at any moment
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump-folder", required=True, help="the run's --job.dump_folder")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's NODE_RANK: node 0 holds the lock")
    parser.add_argument("--export-hf", action="store_true", help="after training, export the latest checkpoint to HF")
    parser.add_argument("--sample", metavar="PROMPT", help="then print a continuation of PROMPT by the export")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    args = parser.parse_args(argv)
    torchrun_args = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun

    lock = None
    if args.node_rank == 0:
        lock = DumpFolderLock(args.dump_folder, shlex.join(["torchrun", *torchrun_args]))
        try:
            lock.acquire()
        except (ConfigError, OSError) as error:
            print(f"flame: error: {error}", file=sys.stderr)
            return 2
        os.environ["FLAME_ATTEMPT"] = str(lock.attempt)
    else:  # rank 0 may run on this node; it numbers the attempt itself, under node 0's lock
        os.environ.pop("FLAME_ATTEMPT", None)
    os.environ[PARENT_PID] = str(os.getpid())  # the ranks' parent: torchrun's agent, this process
    try:
        status = train(torchrun_args)
        if lock is not None:  # node 0, whatever the outcome: a diverged run's curves are the ones to look at
            record_the_run(args.dump_folder, lock.attempt, torchrun_args)
        if status == 0 and args.export_hf:  # under the lock still: no other run may purge the step it reads
            from flame.compat.transformers import scikit_learn_imported_when_used

            scikit_learn_imported_when_used()  # before the export loads transformers' model classes
            from flame.utils.convert_dcp_to_hf import main as export

            status = export(["--path", args.dump_folder, *(["--sample", args.sample] if args.sample else [])])
    finally:
        if lock is not None:
            lock.release()
    return status


if __name__ == "__main__":
    sys.exit(main())
