"""What a run writes besides its checkpoints: metrics.jsonl, TensorBoard and W&B, communication and profiler traces.

None of them may cost training. A write that fails (a full disk, a file made read-only, a folder that
cannot be made) is a warning naming the file and the error, once until the writes succeed again, and
training goes on:
- ``NonFatalLogger`` wraps each metrics logger (flame.training.metrics: metrics.jsonl, and
  torchtitan's TensorBoard and W&B loggers, ``tensorboard_and_wandb``): a failed step is skipped
  in that output alone; when writes succeed again, one line says which steps it lacks;
- ``make_folders`` makes the trace folders before torchtitan does, and turns off an output whose
  folder cannot be made (torchtitan's own ``os.makedirs`` would end the rank);
- a profiler trace or memory snapshot that cannot be written warns from inside the training
  loop (flame.compat.torchtitan.traces_never_stop_training).
"""

import os
from typing import Any

from torchtitan.components.metrics import BaseLogger
from torchtitan.tools.logging import logger

from flame import compat
from flame.base.errors import gist


def _failed(what: str, error: BaseException, consequence: str) -> None:
    logger.warning(f"{what}: not written ({type(error).__name__}: {gist(error)}); {consequence}")


def _no_folder(what: str, path: str, error: OSError, consequence: str) -> None:
    logger.warning(f"{what}: the folder {path} cannot be made ({type(error).__name__}: {gist(error)}); {consequence}")


class NonFatalLogger(BaseLogger):
    """A metrics logger whose failures warn: ``what`` names its output (``metrics.jsonl exp/run/metrics.jsonl``)."""

    def __init__(self, inner: BaseLogger, what: str):
        self.inner, self.what = inner, what
        self.missing_since: int | None = None  # the first step of the current run of failed writes

    def log(self, metrics: dict[str, Any], step: int) -> None:
        try:
            self.inner.log(metrics, step)
        except Exception as error:
            if self.missing_since is None:
                self.missing_since = step
                _failed(f"{self.what}, step {step}", error,
                        "training goes on without it, and says when this output is written again")
            return
        if self.missing_since is not None:
            logger.info(f"{self.what}: written again from step {step}; it lacks the steps logged from "
                        f"{self.missing_since} to {step - 1}")
            self.missing_since = None

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as error:
            _failed(f"{self.what}, its last writes", error, "training is unaffected")


def tensorboard_and_wandb(job_config, parallel_dims, tag: str | None) -> BaseLogger:
    """torchtitan's TensorBoard and W&B loggers for the job, whose failures warn; none when their folder cannot be made."""
    if not (job_config.metrics.enable_tensorboard or job_config.metrics.enable_wandb):
        return BaseLogger()
    folder = os.path.join(job_config.job.dump_folder, job_config.metrics.save_tb_folder)
    try:
        built = compat.torchtitan.build_metric_logger(job_config, parallel_dims, tag)
    except OSError as error:  # SummaryWriter makes <folder>/<date-time> as it starts
        _no_folder("TensorBoard/W&B", folder, error, "training goes on without them")
        return BaseLogger()
    return NonFatalLogger(built, f"TensorBoard/W&B {folder}")


def make_folders(job_config) -> None:
    """Make the folders of the traces this job writes (communication, profiler, memory snapshots); an output whose
    folder cannot be made is turned off, with a warning, instead of ending the run."""
    dump = job_config.job.dump_folder
    comm, profiling = job_config.comm, job_config.profiling
    outputs = (
        ("communication traces", comm.trace_buf_size > 0, comm.save_traces_folder,
         lambda: setattr(comm, "trace_buf_size", 0), "the flight recorder is off for this run"),
        ("profiler traces", profiling.enable_profiling, profiling.save_traces_folder,
         lambda: setattr(profiling, "enable_profiling", False), "profiling is off for this run"),
        ("memory snapshots", profiling.enable_memory_snapshot, profiling.save_memory_snapshot_folder,
         lambda: setattr(profiling, "enable_memory_snapshot", False), "memory snapshots are off for this run"),
    )
    for what, enabled, folder, turn_off, consequence in outputs:
        if not enabled:
            continue
        path = os.path.join(dump, folder)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            turn_off()
            _no_folder(what, path, error, consequence)

