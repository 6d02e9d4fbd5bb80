"""flame's entry point: parse the job config, prepare it (checks, memory plan), build the Trainer, train, close.

    torchrun ... -m flame.train --job.config_file configs/debug.toml --training.steps 100

train.sh's launcher starts its ranks at ``run_rank`` instead, forked from a process that has
imported this module already (flame.launch.supervise).
"""

import signal

if __name__ == "__main__":  # a rank: first of all (importing torch takes seconds), die with torchrun's agent
    from flame.base.process import die_with_parent

    die_with_parent(signal.SIGKILL)
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()  # before the imports below load transformers' model classes

import logging
import multiprocessing
import os
import sys

import torch
from torchtitan.tools.logging import init_logger, logger

from flame.base import autotune, triton_kernels
from flame.base.errors import ConfigError, DataError, SaveFailedError, UpdatesFailingError, failure_line, worker_message
from flame.base.process import arrange_stack_dumps, die_with_parent
from flame.compat import triton as compat_triton
from flame.config.manager import parse
from flame.training import stop


def main(argv: list[str] | None = None) -> int:
    stop.signals().install()  # first: a run signalled while it starts stops before its first step, without a traceback
    init_logger()
    arrange_stack_dumps()
    autotune.share_triton_cache()  # before torch.compile's first kernel would choose another folder
    on_rank0_gpu = os.environ.get("RANK", "0") == "0" and torch.cuda.is_available()
    compiling = compat_triton.compile_watch() if on_rank0_gpu else None  # said in the log while step 1 waits for it
    try:
        if torch.cuda.is_available() and (threads := compat_triton.compile_threads()) > 1:
            compat_triton.configurations_compiled_together(threads)  # a new shape's autotuning compiles side by side
        job = parse(sys.argv[1:] if argv is None else argv)
        if recorded := os.environ.get(triton_kernels.RECORD):  # the kernels this run compiles, to ship (its module doc)
            triton_kernels.record_compiled_kernels(recorded, triton_kernels.model_type_of(job.config.model.config))
        from flame.prepare import prepare  # after parsing: `-h` and parsing errors stay fast

        prepare(job, int(os.environ.get("WORLD_SIZE", "1")))  # train.sh checked it all already; bare torchrun did not
        config = job.config
    except ConfigError as error:
        print(f"flame: error: {error}", file=sys.stderr)
        return 2

    from flame.training.trainer import Trainer  # after parsing: `-h` and config errors stay fast

    trainer = None
    every_rank_stops = True  # the errors caught by name are raised on every rank alike
    try:
        trainer = Trainer(config)
        if compiling is not None:
            step_one_done = lambda: trainer.attempt is not None and trainer.step > trainer.first_step  # noqa: E731
            compiling.report(logger.info, done=step_one_done)
        if config.checkpoint.create_seed_checkpoint:
            # the initial weights, unsharded from one process: every layout can start from them
            trainer.start_attempt()
            trainer.checkpointer.save(curr_step=0, last_step=True)
            if trainer.checkpointer.failures and (why := trainer.checkpointer.failures.failed.get(0)):
                raise SaveFailedError(f"{why}; the seed checkpoint was not made: fix that, then run the same command again")
            logger.info(f"Created the seed checkpoint {trainer.checkpointer.folder}/step-0 (no training step)")
        else:
            trainer.train()
    except DataError as error:  # maybe on this rank only, its peers waiting in a collective: as below
        every_rank_stops = False
        print(f"flame: error: {worker_message(error)}", file=sys.stderr)
        return 2
    except ConfigError as error:
        print(f"flame: error: {error}", file=sys.stderr)
        return 2
    except (UpdatesFailingError, SaveFailedError) as error:
        print(f"flame: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        # Maybe only this rank failed, and its peers wait for it in a collective. Destroying the
        # NCCL process group would wait for them, so the job would hang with the error unprinted.
        # Print it and exit: torchrun then stops the other ranks.
        every_rank_stops = False
        logs = os.path.join(config.job.dump_folder, "logs")
        print(f"flame: error: {failure_line(error, logs, os.environ.get('RANK', '0'))}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if every_rank_stops and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if not trainer.stopping:
        logger.info("Training finished")
    return 0


def run_rank(*argv: str) -> None:
    """A rank started by train.sh's launcher (flame.launch.supervise), forked from it: ``python -m flame.train`` without the imports."""
    die_with_parent(signal.SIGKILL)
    status = main(list(argv))
    # A run that failed may still hold its data loader, whose workers ignore SIGTERM (flame.base.process.
    # ignore_stop_signals), the signal multiprocessing ends its children with before it waits for them: end them here.
    for worker in multiprocessing.active_children():
        worker.kill()
    if status:
        sys.exit(status)


def end_process(status: int) -> None:
    """End a rank started by bare torchrun as train.sh's forked ranks end (multiprocessing's ``os._exit``): its work
    is saved and its output flushed, and the interpreter's teardown is skipped. There C++ destructors race the
    threads still alive (the loader's, gloo's, the compiler's pool) and can abort a finished rank (SIGABRT after
    "Training finished"), which torchrun reports as a failed job."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    end_process(main())
