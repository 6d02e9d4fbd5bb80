"""The pre-launch check of a job: validate the whole job in one process, before any rank starts.

    python -m flame.launch.preflight --world-size 8 [--node-rank 0] -- <train flags>     (check only; exit 0 or 2)

train.sh's launcher (flame.launch.supervise) runs ``check`` in a process forked from it before it starts
torchrun's agent. First it copies flame's shipped autotune choices into this node's Triton cache
(flame.base.autotune), where the memory plan's GPU probe reads them too. It parses the config exactly
as the ranks will (so TOML-only settings count). On node 0 it refuses at once a dump folder that
another run holds (flame.base.dump_folder: it looks, takes nothing, writes nothing; the launcher takes
the lock after this check). It checks the libraries flame changes (flame.compat.check), then
prepares the job as every rank will (flame.prepare: its checks and memory plan) and also loads the
tokenizer, the metadata of the checkpoint the run would load and every data source, and checks that
the HF export after training may replace <dump_folder>/hf (flame.checkpoint.destination): bad input, or a library
flame's changes no longer fit, fails here, in seconds, before any rank exists. Built-in corpora
are built here once, not by every rank. What the launcher needs from the job comes back as a
``LaunchPlan``.
"""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

if __name__ == "__main__":  # before the imports below load transformers' model classes
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()

from flame.base import autotune, dump_folder

from flame import compat
from flame.config.manager import parse
from flame.base.errors import ConfigError
from flame.checkpoint import destination
from flame.checkpoint.steps import complete_steps
from flame.prepare import prepare


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs from a checked job."""

    dump_folder: str
    saves_checkpoints: bool  # False under --checkpoint.no-enable or load_only: nothing to export to HF
    checkpoint_folder: str
    complete_at: int | None = None  # the last step, already saved: a rerun that would train nothing


    def log_folder(self, node_rank: int, nodes: int) -> str:
        """Where torchrun's agent writes the ranks' logs: one folder per node when there are several."""
        logs = os.path.join(self.dump_folder, "logs")
        return os.path.join(logs, f"node{node_rank}") if nodes > 1 else logs


def check(train_args: list[str], world_size: int, node_rank: int = 0,
          parsed: Callable[[object], None] | None = None) -> LaunchPlan:
    """Check the job ``train_args`` describes for ``world_size`` processes; raise ConfigError on bad input.
    ``parsed`` is called with the job's config once it is read, before the slow parts (sources, the memory plan)."""
    os.environ["WORLD_SIZE"] = str(world_size)
    compat.triton.compile_threads()  # a bad FLAME_COMPILE_THREADS is refused here, not in every rank
    # first: the memory plan's GPU probe (flame.prepare) runs fla's kernels and reads their choices too
    try:  # a cache that cannot be written only costs the benchmarks the choices would have saved
        if copied := autotune.install():
            print(f"flame: {copied} shipped autotune choices copied into Triton's cache ({autotune.triton_cache_dir()})")
    except OSError as error:
        print(f"flame: warning: the shipped autotune choices were not installed ({error}); fla's kernels tune "
              "on first use instead", file=sys.stderr)
    job = parse(train_args)
    config = job.config
    if parsed is not None:
        parsed(config)
    if node_rank == 0 and config.job.dump_folder.strip():  # the other nodes join node 0's run, which holds the lock
        dump_folder.check_free(config.job.dump_folder)
    compat.check(config)
    prepare(job, world_size, sources=True)  # also sets a damaged latest step aside: what is complete is known after it
    checkpoints = os.path.join(config.job.dump_folder, config.checkpoint.folder)
    saves = config.checkpoint.enable and not config.checkpoint.load_only  # load_only never saves
    if saves:  # the export after training replaces <dump_folder>/hf: refused now, not after the whole run
        export = os.path.join(config.job.dump_folder, "hf")
        destination.check(export, f"the run's HF export folder {export}", "give another --job.dump_folder")
    steps = complete_steps(checkpoints) if saves and config.checkpoint.load_step == -1 else []
    complete_at = steps[-1] if steps and steps[-1] >= config.training.steps else None  # nothing left to train
    return LaunchPlan(config.job.dump_folder, saves, checkpoints, complete_at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="processes the job will run (NGPU x NNODE)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's NODE_RANK (node 0 holds the lock)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        plan = check(train_args, args.world_size, args.node_rank)
    except ConfigError as error:
        print(f"flame: error: {error}", file=sys.stderr)
        return 2
    print(f"flame: the job checks out; it writes to {plan.dump_folder}")
    return 0


if __name__ == "__main__":
    sys.argv[0] = "bash train.sh"  # tyro's error for a misspelt flag ends "For full helptext, run <argv[0]> --help"
    sys.exit(main())
