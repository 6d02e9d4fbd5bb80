"""torchtitan's seam: flame's changes to torchtitan, and the private names of torchtitan flame uses.

Written for torchtitan 0.2.2 (3rdparty/requirements.txt). flame uses torchtitan's private names
only through the functions here (``checkpoint_block``, ``build_metric_logger``,
``purge_stale_checkpoints``), plus two ``ConfigManager`` hooks that flame.config.manager
overrides; ``PRIVATE_NAMES`` lists them all, and ``check_private_names`` (run at startup by
flame.compat.apply) refuses a torchtitan that lacks one or changed its signature. The
``CheckpointManager`` methods flame.checkpoint.manager overrides are the targets of
``checkpoints_with_manifests``, checked the same way.
"""

import contextlib
import functools
import importlib
import inspect
import logging
import time
from collections.abc import Callable

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import BaseLogger
from torchtitan.config import ActivationCheckpoint, JobConfig
from torchtitan.distributed import ParallelDims

from flame.compat.guard import Library, Target, patch
from flame.base.device import CpuDeviceModule

TORCHTITAN = Library("torchtitan", "torchtitan", "0.2.2")

# torchtitan modules that bind device_type/device_module at import time -> the names they bind
_DEVICE_GLOBALS = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.tools.profiling": ("device_module",),
}
_MAYBE_ENABLE_AMP = Target(
    TORCHTITAN, "torchtitan.distributed.utils", "maybe_enable_amp", ("parallel_dims", "mixed_precision_param", "device_type")
)
_GET_PEAK_FLOPS = Target(TORCHTITAN, "torchtitan.tools.utils", "get_peak_flops", ("device_name",))
_INIT_DISTRIBUTED = Target(TORCHTITAN, "torchtitan.distributed.utils", "init_distributed",
                           ("comm_config", "enable_cpu_backend"))


@patch(
    TORCHTITAN,
    *(Target(TORCHTITAN, module, name) for module, names in _DEVICE_GLOBALS.items() for name in names),
    _MAYBE_ENABLE_AMP,
    _GET_PEAK_FLOPS,
    _INIT_DISTRIBUTED,
)
def cpu_without_accelerator() -> None:
    """Run torchtitan on the CPU with gloo when the machine has no CUDA device.

    Upstream: ``torchtitan.tools.utils`` picks the device type at import and falls back to
    "cuda"/``torch.cuda`` without an accelerator; four more modules import those two names, so
    process groups, meshes, memory monitors and the profiler would all ask for CUDA.
    ``maybe_enable_amp`` autocasts the forward in --training.mixed_precision_param, and
    ``get_peak_flops`` guesses an A100 for an unknown device. Under --training.enable_cpu_offload
    ``init_distributed`` adds a gloo backend for CPU tensors to the device's, which on the CPU names gloo
    twice, an error.
    flame: points each module's ``device_type``/``device_module`` at "cpu" and
    ``flame.base.device.CpuDeviceModule`` (those modules read the globals at call time), runs the
    forward without autocast (CPU runs compute in fp32), reports no peak FLOPS (NaN: a CPU
    has no MFU), and starts the process group without the second backend (gloo serves the CPU
    already). flame.base.device decides everything else that differs on the CPU.
    """
    for module_name, names in _DEVICE_GLOBALS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, "cpu" if name == "device_type" else CpuDeviceModule)
    importlib.import_module(_MAYBE_ENABLE_AMP.module).maybe_enable_amp = lambda *args, **kwargs: contextlib.nullcontext()
    importlib.import_module(_GET_PEAK_FLOPS.module).get_peak_flops = lambda device_name: float("nan")
    module = importlib.import_module(_INIT_DISTRIBUTED.module)
    upstream = module.init_distributed
    module.init_distributed = functools.wraps(upstream)(
        lambda comm_config, enable_cpu_backend=False, **kwargs: upstream(comm_config, False, **kwargs))


_TRAINER_CHECKPOINT_MANAGER = Target(
    TORCHTITAN, "torchtitan.train", "CheckpointManager",
    holds=lambda value: isinstance(value, type) and issubclass(value, CheckpointManager),
    shape="torchtitan.components.checkpoint.CheckpointManager",
)
# the methods flame.checkpoint.manager.FlameCheckpointManager overrides or extends
_CHECKPOINT_METHODS = tuple(
    Target(TORCHTITAN, "torchtitan.components.checkpoint", f"CheckpointManager.{name}", parameters)
    for name, parameters in (
        ("dcp_save", ("self", "state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf")),
        ("save", ("self", "curr_step", "last_step")),
        ("_async_wait", ("self",)),
        ("load", ("self", "step")),
        ("_find_load_step", ("self", "folder")),
        ("_purge_stale_checkpoints", ("self",)),
        ("close", ("self",)),
    )
)


@patch(TORCHTITAN, _TRAINER_CHECKPOINT_MANAGER, *_CHECKPOINT_METHODS)
def checkpoints_with_manifests(manager: type) -> None:
    """Record a manifest of every checkpoint step, and load only steps whose files match theirs.

    Upstream: a step counts as saved once DCP's ``.metadata`` is there; a truncated or changed
    file fails deep inside DCP's load (or unpickling ``.metadata``) without naming it; a folder
    whose name merely contains ``step-N`` counts as step N, for loading and for
    ``--checkpoint.keep_latest_k``'s purge alike; a save that cannot be written (a full disk) ends
    the run with a traceback from every rank.
    flame: torchtitan's Trainer builds ``manager`` (flame.checkpoint.manager.FlameCheckpointManager),
    which records each step's manifest after its save, checks a step against it before loading,
    sets a damaged latest step aside and loads the newest intact one, counts only folders
    named exactly ``step-N``, and notes a save that cannot be written instead of ending the run.
    """
    importlib.import_module(_TRAINER_CHECKPOINT_MANAGER.module).CheckpointManager = manager


class _TimeWithoutSleep:
    """The ``time`` module as torchtitan.train sees it after ``ends_without_sleep``: all of it but ``sleep``."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


_TRAIN_SLEEP = "time.sleep(2)"  # Trainer.train's only sleep: rank 0's, after the last step
_TRAIN_TIME = Target(
    TORCHTITAN, "torchtitan.train", "time",
    holds=lambda value: value is time or isinstance(value, _TimeWithoutSleep), shape="the time module",
)
_TRAINER_TRAIN = Target(
    TORCHTITAN, "torchtitan.train", "Trainer.train", ("self",),
    holds=lambda value: inspect.getsource(value).count(_TRAIN_SLEEP) == 1,
    shape=f"a function calling {_TRAIN_SLEEP} once",
)


@patch(TORCHTITAN, _TRAIN_TIME, _TRAINER_TRAIN)
def ends_without_sleep() -> None:
    """Let rank 0 finish training without waiting 2 s.

    Upstream: ``Trainer.train`` ends, on rank 0 only, with ``time.sleep(2)`` "for other ranks to
    complete" (the module's only sleep). Nothing waits on it: the last step's collectives and the
    last checkpoint's save have finished on every rank, and torchrun's agent, not rank 0, hosts
    the rendezvous store the other ranks still use. flame: torchtitan.train's ``time`` is the
    time module without ``sleep`` (its other use, ``perf_counter``, unchanged), 2 s off every run;
    torchtitan's log line announcing the sleep stays.
    """
    importlib.import_module(_TRAIN_TIME.module).time = _TimeWithoutSleep()


_PROFILING = Target(TORCHTITAN, "torchtitan.train", "maybe_enable_profiling", ("profiling_config",))
_MEMORY_SNAPSHOT = Target(TORCHTITAN, "torchtitan.train", "maybe_enable_memory_snapshot", ("profiling_config",))


def _writes_that_warn(enable: Callable, writer: str, what: str) -> Callable:
    """``enable`` (a context manager yielding a profiler or None) whose profiler's ``writer`` warns instead of raising."""
    @contextlib.contextmanager
    @functools.wraps(enable)
    def enabled(profiling_config, **kwargs):
        with enable(profiling_config, **kwargs) as profiler:
            if profiler is not None and getattr(profiler, writer, None) is not None:
                write = getattr(profiler, writer)

                def guarded(*args, **kwargs):
                    try:
                        return write(*args, **kwargs)
                    except Exception as error:
                        logging.getLogger().warning(f"{what}: not written ({type(error).__name__}: {error}); training "
                                                    "goes on")
                setattr(profiler, writer, guarded)
            yield profiler
    return enabled


@patch(TORCHTITAN, _PROFILING, _MEMORY_SNAPSHOT)
def traces_never_stop_training() -> None:
    """Let a profiler trace or a memory snapshot that cannot be written cost only itself.

    Upstream: torchtitan's profiler writes a trace every --profiling.profile_freq steps, and its
    memory profiler a snapshot, from inside the training loop: a write that fails (a full disk, a
    folder made read-only) raises there and ends the run. flame: the loop's profiler has its trace
    handler (``on_trace_ready``), and the memory profiler its ``step``, warn instead (their folders are
    made, or the output turned off, before: flame.training.side_outputs.make_folders).
    """
    module = importlib.import_module(_PROFILING.module)
    module.maybe_enable_profiling = _writes_that_warn(module.maybe_enable_profiling, "on_trace_ready", "a profiler trace")
    module.maybe_enable_memory_snapshot = _writes_that_warn(module.maybe_enable_memory_snapshot, "step",
                                                            "a memory snapshot")


class _FlameLogLines(logging.Filter):
    """torchtitan's startup and shutdown lines as ``readable_log`` leaves them (its docstring lists them)."""

    DROPPED = ("Sleeping 2 seconds for other ranks", "Training completed", "[GC] ", "Destroying the purge thread",
               "Successfully created meshes with active dimensions: []")
    DROPPED_ON_CPU = ("Peak FLOPS used for computing MFU", "ENV[TORCH_NCCL_", "Synchronizing and adjusting timeout")

    def __init__(self, model: str, on_cpu: bool, model_dump: bool):
        super().__init__()
        self.model, self.model_dump = model, model_dump
        self.dropped = self.DROPPED + (self.DROPPED_ON_CPU if on_cpu else ())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.dropped):
            return False
        if message.startswith(_MODEL_DUMP):
            if not self.model_dump:
                return False
            record.msg, record.args = f"Model {self.model}: {message[len(_MODEL_DUMP):].removeprefix('with ')}", ()
        elif _MODEL_NAME in message:
            record.msg, record.args = message.replace(_MODEL_NAME, self.model), ()
        return True


_MODEL_NAME = "flame debugmodel"  # the registered train spec and flavor, which torchtitan logs as the model's name
_MODEL_DUMP = f"Building {_MODEL_NAME}"


@patch(TORCHTITAN)
def readable_log(model: str, on_cpu: bool, model_dump: bool) -> None:
    """Say what flame trains in the log, without lines that mean nothing for the run.

    Upstream: torchtitan names the model by its train spec and flavor ("flame debugmodel" for every
    flame run), prints the model's arguments as 40 lines of JSON, announces a sleep flame removed
    (``ends_without_sleep``), "Training completed" before flame's last checkpoint, its garbage
    collections and threads, and on a CPU a NaN peak, NCCL settings and timeouts that apply to GPUs.
    flame: a filter on torchtitan's logger names the model (``model``: its type and config), prints
    the arguments only under --job.print_config (``model_dump``), and drops the other lines.
    """
    logging.getLogger().addFilter(_FlameLogLines(model, on_cpu, model_dump))


# torchtitan's private names flame relies on (resolved when used, so that the guard can name a missing one)
_APPLY_AC = Target(
    TORCHTITAN, "torchtitan.distributed.activation_checkpoint", "_apply_ac_to_transformer_block",
    ("module", "ac_config", "base_fqn", "model_compile_enabled", "op_sac_save_list"),
)
_OP_SAC_SAVE_LIST = Target(
    TORCHTITAN, "torchtitan.models.llama3.infra.parallelize", "_op_sac_save_list",
    holds=lambda value: isinstance(value, set), shape="a set of ops",
)
_BUILD_METRIC_LOGGER = Target(
    TORCHTITAN, "torchtitan.components.metrics", "_build_metric_logger", ("job_config", "parallel_dims", "tag")
)
_PURGE_STALE_CHECKPOINTS = Target(
    TORCHTITAN, "torchtitan.components.checkpoint", "CheckpointManager._purge_stale_checkpoints", ("self",)
)
# hooks of torchtitan's ConfigManager that flame.config.manager.FlameConfigManager overrides
_DICT_TO_DATACLASS = Target(TORCHTITAN, "torchtitan.config.manager", "ConfigManager._dict_to_dataclass", ("self", "cls", "data"))
_VALIDATE_CONFIG = Target(TORCHTITAN, "torchtitan.config.manager", "ConfigManager._validate_config", ("self",))
# flame.config.merge.merge_configs: the merge keeps flame's field help for -h
_MERGE_CONFIGS = Target(TORCHTITAN, "torchtitan.config.manager", "ConfigManager._merge_configs", ("base", "custom"))

PRIVATE_NAMES = (
    _APPLY_AC, _OP_SAC_SAVE_LIST, _BUILD_METRIC_LOGGER, _PURGE_STALE_CHECKPOINTS, _DICT_TO_DATACLASS, _VALIDATE_CONFIG,
    _MERGE_CONFIGS,
)


def check_private_names() -> None:
    """Refuse to start when torchtitan lacks a private name flame relies on, or changed its signature."""
    for target in PRIVATE_NAMES:
        target.require(f"flame's use of torchtitan's {target.path}")


def checkpoint_block(
    block: torch.nn.Module, ac_config: ActivationCheckpoint, *, base_fqn: str, model_compile_enabled: bool
) -> torch.nn.Module:
    """``block`` under activation checkpointing (full, or selective per-N-blocks / op-level).

    torchtitan's ``_apply_ac_to_transformer_block``, with llama3's op-level save list (which ops'
    outputs op-level SAC keeps: matmuls and attention): torchtitan applies it only inside its own
    models' parallelize functions.
    """
    return _APPLY_AC.resolve()(
        block, ac_config, base_fqn=base_fqn, model_compile_enabled=model_compile_enabled,
        op_sac_save_list=_OP_SAC_SAVE_LIST.resolve(),
    )


def op_sac_save_list() -> set:
    """The ops whose outputs torchtitan's op-level selective AC keeps (flame.memory measures what they hold)."""
    return _OP_SAC_SAVE_LIST.resolve()


def build_metric_logger(job_config: JobConfig, parallel_dims: ParallelDims, tag: str | None = None) -> BaseLogger:
    """torchtitan's TensorBoard/W&B logger for the job (its private ``_build_metric_logger``)."""
    return _BUILD_METRIC_LOGGER.resolve()(job_config, parallel_dims, tag)


def purge_stale_checkpoints(checkpointer: CheckpointManager) -> None:
    """Apply --checkpoint.keep_latest_k now (torchtitan's private ``CheckpointManager._purge_stale_checkpoints``)."""
    checkpointer._purge_stale_checkpoints()
