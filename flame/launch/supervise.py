"""train.sh's launcher on each node: the job's check, then torchrun's agent, living exactly as long as train.sh.

    FLAME_PARENT_PID=$$ python -m flame.launch.supervise --world-size 2 [--nodes 1] [--node-rank 0] [--sample PROMPT] \\
        [--dry-run] -- <torchrun arguments> -m flame.train <train flags>

One process per node does the whole launch, so that what every rank imports is imported once:

- it imports what the config needs and forks the job's check from itself (flame.launch.preflight.check:
  bad input fails there, before any rank exists, and ends this process at once), imports the
  rest of what the ranks import beside it (torch, torchtitan, transformers, flame's trainer:
  ``warm_up``), then runs torchrun's agent in this very process, which forks the ranks from it
  too. A rank then starts at its config instead of at its imports. Forking needs a process that
  has not started CUDA, so nothing imported here may touch the GPU (fla asks it for its name, so
  fla is imported by the check and the ranks, never here); if something did, the ranks are
  spawned (started fresh, as bare torchrun starts them) and the launcher says why;
- where flame ships a list of fla's Triton kernels for this GPU, it starts their compilation on the
  spare CPUs first (flame.base.triton_kernels); the check tells it the job's model type once it has
  parsed the job, so that the check's memory-plan probe and the ranks find that type's kernels in
  Triton's cache;
- the run's processes end with train.sh, however it ends: this process asks the kernel for
  SIGTERM when train.sh (its parent) exits, and torchrun's own handler then stops the ranks;
  every rank asks for SIGKILL when the agent exits (flame.train.run_rank calls
  ``die_with_parent`` first), which covers an agent killed outright (bare torchrun starts its
  ranks in sessions of their own, which nothing of this kind ties to the launch);
- on node 0 it holds the dump folder's lock for the run's life, the HF export after training
  included (when the run saves checkpoints), and picks the attempt number, passed to the ranks as
  FLAME_ATTEMPT; after training it records the attempt's command line and draws
  <dump_folder>/curves.png (flame.tools.plot). Other nodes neither lock, number, draw nor export.

Linux only (prctl PR_SET_PDEATHSIG); elsewhere the processes run untied, as under bare torchrun.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import shlex
import signal
import sys
import time
import uuid
from typing import TYPE_CHECKING

from flame.base.dump_folder import DumpFolderLock
from flame.base.run_record import take_stop_record
from flame.base import progress, triton_kernels
from flame.base.process import PARENT_PID, die_with_parent, ranks_of
from flame.base.errors import ConfigError, gist
from flame.launch import summary

if TYPE_CHECKING:
    from flame.launch.preflight import LaunchPlan

def import_config() -> None:
    """Import what the job's check parses the config with; it is forked with them, the ranks later with more.

    torch asks NVML, not CUDA, whether there is a GPU (PYTORCH_NVML_BASED_CUDA_CHECK): CUDA started in
    this process would fail in every process forked from it.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from flame.base import autotune

    autotune.share_triton_cache()  # the check installs the shipped choices where the ranks will read them
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()  # first, as in a rank: before transformers' model classes load
    import flame.config.manager  # noqa: F401


def warm_up() -> str:
    """Import what every rank imports; the start method that keeps it for the ranks: fork, or spawn and why not."""
    import_config()
    import flame.train
    import flame.training.trainer  # noqa: F401  (what flame.train imports once the config parses)

    if why := cuda_started():
        print(f"flame: warning: the ranks start fresh (spawned), each importing torch again: {why}", file=sys.stderr)
        return "spawn"
    return "fork"


def cuda_started() -> str | None:
    """Why this process may not fork processes that use the GPU (something here started CUDA), or None.

    The driver itself tells: before anything in the process called cuInit (torch's CUDA init,
    fla's import asking the GPU its name), it answers CUDA_ERROR_NOT_INITIALIZED.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None  # no NVIDIA driver on this machine
    count = ctypes.c_int()
    not_initialized = 3  # CUDA_ERROR_NOT_INITIALIZED
    if libcuda.cuDeviceGetCount(ctypes.byref(count)) != not_initialized:
        return "a library imported before the ranks started initialized the CUDA driver"
    return None


class JobCheck:
    """flame.launch.preflight.check in a process forked from this one, while this one imports the rest for the ranks.

    What the check imports (fla starts CUDA) and loads (datasets, tokenizers) stays out of the
    process the ranks are forked from. A refusal ends this process at once, whatever it is
    importing: the check prints why, then sends ``REFUSED``, so a misspelt flag costs the config's
    imports, not the trainer's.
    """

    REFUSED = signal.SIGUSR2

    def __init__(self, train_args: list[str], world_size: int, node_rank: int,
                 kernels: triton_kernels.WarmUp | None = None):
        signal.signal(self.REFUSED, lambda *_: os._exit(2))  # the check has printed the error: nothing to clean up
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_check_in_child, name="flame-check",
                                        args=(send, train_args, world_size, node_rank, os.getpid(), kernels))
        self._process.start()
        send.close()

    def outcome(self) -> LaunchPlan | int:
        """The checked job's LaunchPlan, or the exit status of a check that failed without refusing (1)."""
        try:
            outcome = self._receive.recv()
        except EOFError:  # it died without an answer: its traceback is on stderr
            outcome = 1
        self._process.join()
        # from now on a stray SIGUSR2 (the ranks' stack-dump signal, sent to the whole group) must not end the launcher
        signal.signal(self.REFUSED, signal.SIG_IGN)
        return outcome


def _check_in_child(send, train_args: list[str], world_size: int, node_rank: int, parent: int,
                    kernels: triton_kernels.WarmUp | None) -> None:
    signal.signal(JobCheck.REFUSED, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops, and this check with it (SIGTERM)
    die_with_parent(signal.SIGTERM, parent)
    from flame.launch import preflight

    # the memory plan's GPU probe runs fla's kernels at its own rows: the first on a machine compiles (and may tune)
    # them here, so they are said, like step 1's, and recorded for the shipped list (flame.base.triton_kernels)
    checked = False
    if triton_kernels.NVIDIA_DEVICE.exists():
        from flame.compat import triton

        triton.compile_watch().report(lambda line: print(f"flame: {line}", file=sys.stderr, flush=True),
                                      done=lambda: checked, what="the job's check (its memory plan's GPU probe)")

    def parsed(config) -> None:  # before the probe
        model_type = triton_kernels.model_type_of(config.model.config)
        if kernels is not None:
            kernels.tell(model_type)
        if recorded := os.environ.get(triton_kernels.RECORD):
            triton_kernels.record_compiled_kernels(recorded, model_type)

    try:
        send.send(preflight.check(train_args, world_size, node_rank, parsed))
        checked = True
    except ConfigError as error:
        print(f"flame: error: {error}", file=sys.stderr, flush=True)
        os.kill(parent, JobCheck.REFUSED)


def train(torchrun_args: list[str], start_method: str) -> int:
    """Run torchrun's agent in this process: 0 when every rank finished, else a status after one line saying why.

    ``torchrun_args`` are torchrun's own command line, ending ``-m flame.train <train flags>``; the
    agent starts each rank as ``flame.train.run_rank(<train flags>)`` by ``start_method``.
    """
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from flame.train import run_rank

    from flame.compat import torchrun

    torchrun.first_signal_waits_for_the_save(pass_on_to_the_ranks, lambda: bool(ranks_of(os.getpid())))
    torchrun.failures_without_tracebacks()
    torchrun.every_ended_rank_reported()
    torchrun.failed_runs_end_sooner()
    logs = torchrun_args[torchrun_args.index("--log-dir") + 1] if "--log-dir" in torchrun_args else "torchrun's log folder"
    try:
        args = run.parse_args(["--start-method", start_method, *torchrun_args])
        if args.standalone:  # as torchrun does: a rendezvous on this host, under a fresh id
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        config, _, _ = run.config_from_args(args)
        elastic_launch(config=config, entrypoint=run_rank)(*args.training_script_args)
    except SignalException as error:  # a second signal: the ranks are killed (flame.compat.torchrun)
        print("flame: stopped at once by a second signal; steps after the last checkpoint are lost", file=sys.stderr)
        return 128 + error.sigval
    except ChildFailedError as error:  # each rank printed its own line (its traceback is in its log folder)
        print(f"flame: {summary.failed(error.failures, logs)}", file=sys.stderr)  # the rank printed its error line
        return 1
    except Exception as error:  # torchrun's agent itself (its rendezvous, its processes): its words, one line
        print(f"flame: error: torchrun's agent failed: {gist(error)} ({type(error).__name__}); per-rank logs are in "
              f"{logs}", file=sys.stderr)
        return 1
    return 0


def pass_on_to_the_ranks(sig: signal.Signals) -> None:
    """The agent's first stop signal: the ranks save after their step (a terminal's Ctrl-C reached them already)."""
    print(f"flame: {sig.name}: finishing the current step and saving it; a second signal stops at once, "
          "losing the steps since the last checkpoint", file=sys.stderr, flush=True)
    for pid in ranks_of(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


def record_the_run(dump_folder: str, attempt: int, torchrun_args: list[str]) -> None:
    """After training: the attempt's train.sh command line (for the model card) and <dump_folder>/curves.png.

    Neither may fail the run or its export: a problem is a warning.
    """
    try:
        from flame.tools import plot
        from flame.base import run_record

        run_record.record_command(dump_folder, attempt, torchrun_args)
        if curves := plot.write_run_curves(dump_folder):
            print(f"flame: the run's curves are in {curves}")
    except Exception as error:
        print(f"flame: warning: the run's command line or curves were not recorded ({type(error).__name__}: {gist(error)}); "
              f"nothing else depends on them; draw the curves with: python -m flame.tools.plot {dump_folder}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)  # first: train.sh may be killed at any moment
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="processes the job runs (NGPU x NNODE)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the job runs on (NNODE)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's NODE_RANK: node 0 holds the lock")
    parser.add_argument("--sample", metavar="PROMPT", help="after the HF export, print a continuation of PROMPT by it")
    parser.add_argument("--dry-run", action="store_true", help="check the job, print the torchrun command, start nothing")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="-- then torchrun's arguments, -m flame.train <flags>")
    args = parser.parse_args(argv)
    torchrun_args = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun
    script = torchrun_args.index("-m") if "-m" in torchrun_args else len(torchrun_args)
    if torchrun_args[script + 1:script + 2] != ["flame.train"]:
        parser.error("torchrun's arguments must end with -m flame.train <train flags>")
    try:
        return launch(args, torchrun_args, script)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent started the ranks: they never existed
        print("\nflame: interrupted before training started; nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT


def launch(args: argparse.Namespace, torchrun_args: list[str], script: int) -> int:
    """Check the job, run it under the dump folder's lock (node 0), then export it and say how it went."""
    import_config()
    kernels = triton_kernels.start_warm_up()  # fla's kernels compile on the spare CPUs meanwhile (its module doc)
    try:
        return _checked_and_run(args, torchrun_args, script, kernels)
    finally:
        if kernels is not None:
            kernels.stop()


def _checked_and_run(args: argparse.Namespace, torchrun_args: list[str], script: int,
                     kernels: triton_kernels.WarmUp | None) -> int:
    train_args = torchrun_args[script + 2:]
    check = JobCheck(train_args, args.world_size, args.node_rank, kernels)
    if kernels is not None:
        kernels.release()  # the check holds its own end of the pipe now
    start_method = warm_up()
    plan = check.outcome()
    if isinstance(plan, int):
        return plan
    torchrun_args[script:script] = ["--log-dir", plan.log_folder(args.node_rank, args.nodes)]
    if args.dry_run:
        print(f"flame: dry run, node {args.node_rank} of {args.nodes} would run: {shlex.join(['torchrun', *torchrun_args])}")
        return 0
    if plan.complete_at is not None:
        print(summary.already_complete(plan.complete_at))
        return 0

    lock = None
    if args.node_rank == 0:
        lock = DumpFolderLock(plan.dump_folder, shlex.join(["torchrun", *torchrun_args]))
        try:  # the check only looked: another run may have taken the folder since
            lock.acquire()
        except (ConfigError, OSError) as error:
            print(f"flame: error: {error}", file=sys.stderr)
            return 2
        os.environ["FLAME_ATTEMPT"] = str(lock.attempt)
        take_stop_record(plan.dump_folder)  # an earlier attempt's, which its launcher did not live to read
    else:  # rank 0 may run on this node; it numbers the attempt itself, under node 0's lock
        os.environ.pop("FLAME_ATTEMPT", None)
    os.environ[PARENT_PID] = str(os.getpid())  # the ranks' parent: torchrun's agent, this process
    os.environ[progress.PROGRESS_DIR] = os.path.join(plan.log_folder(args.node_rank, args.nodes), "progress")
    progress.clear(os.environ[progress.PROGRESS_DIR])  # an earlier attempt's notes would name the wrong rank
    started = time.monotonic()
    try:
        status = train(torchrun_args, start_method)
        if lock is None:
            return status
        record_the_run(plan.dump_folder, lock.attempt, torchrun_args)  # whatever the outcome: a diverged run's curves
        if status != 0:
            return status
        if stop := take_stop_record(plan.dump_folder):
            print(summary.stopped(stop, train_args), file=sys.stderr)
            return 128 + getattr(signal, stop["signal"], signal.SIGTERM)
        export = None
        if not plan.saves_checkpoints:
            print("flame: this run saves no checkpoint (--checkpoint.enable off, or --checkpoint.load_only), "
                  "so there is nothing to export to HF")
        else:
            from flame.checkpoint.export import main as export_to_hf

            # under the lock: no other run may purge the step it reads
            status = export_to_hf(["--path", plan.dump_folder, *(["--sample", args.sample] if args.sample else [])])
            if status != 0:
                return status
            export = os.path.join(plan.dump_folder, "hf")
        print(summary.finished(plan.dump_folder, plan.checkpoint_folder, time.monotonic() - started, export))
        return 0
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.argv[0] = "bash train.sh"  # tyro's error for a misspelt flag ends "For full helptext, run <argv[0]> --help"
    sys.exit(main())
