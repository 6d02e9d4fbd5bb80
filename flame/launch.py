"""Pre-launch check for train.sh: validate the whole job in one process, print what the launcher needs.

    python -m flame.launch --world-size 8 [--node-rank 0] --env-file plan.sh -- <train flags> && source plan.sh

Parses the config exactly as the ranks will (so TOML-only settings count). On node 0, refuses at
once a dump folder that another run holds (flame.dump_folder: it looks, takes nothing, writes
nothing; the launcher takes the lock after this check). Then it loads the
tokenizer, the model config, the metadata of the checkpoint the run would load and every data
source, and checks the libraries flame changes (flame.compat.check): bad input, or a library
flame's changes no longer fit, fails here, in seconds, before torchrun starts any process.
Built-in corpora are built here once, not by every rank, and flame's shipped autotune choices
are copied into this node's Triton cache (flame.autotune). Writes shell assignments to --env-file:
FLAME_DUMP_FOLDER, FLAME_CHECKPOINT (1 if checkpoints are saved) and, under the memory plan,
PYTORCH_CUDA_ALLOC_CONF for the ranks (``PLANNED_ALLOCATOR``).
"""

import argparse
import os
import shlex
import sys

if __name__ == "__main__":  # train.sh's preflight: before the imports below load transformers' model classes
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()

from flame import autotune, compat, dump_folder
from flame.config_manager import FlameConfigManager
from flame.errors import ConfigError
from flame.preflight import check_job

# Under the memory plan the ranks' CUDA allocator maps memory in growing segments instead of fixed
# blocks: what it reserves then follows what the tensors take, which the plan's 10% margin covers
# (fla transformer 1B, FSDP over 2 GPUs: 17.3 GiB reserved for 13.1 allocated without it, 15.6 with it;
# docs/perf-log.md, 2026-11-27). A PYTORCH_CUDA_ALLOC_CONF of the user's own is left as it is.
PLANNED_ALLOCATOR = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="processes the job will run (NGPU x NNODE)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's NODE_RANK (node 0 holds the lock)")
    parser.add_argument("--env-file", required=True, help="where to write the shell assignments")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    os.environ["WORLD_SIZE"] = str(args.world_size)
    try:
        config = FlameConfigManager().parse_args(train_args)
        if args.node_rank == 0:  # the other nodes join node 0's run, which holds the lock
            dump_folder.check_free(config.job.dump_folder)
        compat.check(config)
        check_job(config)
    except ConfigError as error:
        print(f"flame: error: {error}", file=sys.stderr)
        return 2
    try:  # a cache that cannot be written only costs the benchmarks the choices would have saved
        if copied := autotune.install():
            print(f"flame: {copied} shipped autotune choices copied into Triton's cache ({autotune.triton_cache_dir()})")
    except OSError as error:
        print(f"flame: warning: the shipped autotune choices were not installed ({error}); fla's kernels tune "
              "on first use instead", file=sys.stderr)
    with open(args.env_file, "w") as f:
        f.write(f"FLAME_DUMP_FOLDER={shlex.quote(config.job.dump_folder)}\n")
        saves = config.checkpoint.enable and not config.checkpoint.load_only  # load_only: loads, never saves
        f.write(f"FLAME_CHECKPOINT={int(saves)}\n")
        if config.memory.plan == "auto" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            f.write(f"export PYTORCH_CUDA_ALLOC_CONF={PLANNED_ALLOCATOR}\n")
    return 0


if __name__ == "__main__":
    sys.argv[0] = "bash train.sh"  # tyro's error for a misspelt flag ends "For full helptext, run <argv[0]> --help"
    sys.exit(main())
