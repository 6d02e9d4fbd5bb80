"""triton's seam: how Triton's autotuner waits for its benchmarks under pipeline parallelism, how
many configurations it is about to try, compiles them side by side, runs that skip its benchmarks, and forwards in
which no kernel may launch.

Written for triton 3.6.0 (3rdparty/requirements.txt).
"""

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from flame.base.compile_watch import CompileWatch
from flame.base.errors import ConfigError
from flame.compat.guard import Library, Target, patch

TRITON = Library("triton", "triton", "3.6.0")


class _CurrentStreamCuda:
    """``torch.cuda`` as Triton's benchmark sees it, except that ``synchronize`` waits for the current stream only."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        torch.cuda.current_stream().synchronize()


_DEVICE_INTERFACE = Target(TRITON, "triton.backends.nvidia.driver", "CudaDriver.get_device_interface", ("self",))


@patch(TRITON, _DEVICE_INTERFACE)
def autotune_on_the_current_stream() -> None:
    """Keep Triton's autotuning (fla's kernels, the first time a shape runs) from deadlocking a pipeline.

    Upstream: Triton times its candidate kernels with ``torch.cuda.synchronize()``, a wait for
    every stream of the device (the interface ``CudaDriver.get_device_interface`` returns).
    flame: the benchmarks wait for the current stream only. A pipeline stage has NCCL receives
    posted on other streams that complete only when its peer stage sends; when both stages
    autotune at once, each waits for the other's receive and step 1 never ends. The benchmarks
    run on the current stream, so waiting for that stream alone times them the same.
    Applied to pipeline-parallel runs on CUDA only (flame.compat.apply).
    """
    driver = importlib.import_module(_DEVICE_INTERFACE.module)
    driver.CudaDriver.get_device_interface = lambda self: _CurrentStreamCuda()


_PRUNE = Target(TRITON, "triton.runtime.autotuner", "Autotuner.prune_configs", ("self", "kwargs"))
# kernel name -> how many configurations its autotuner tries for its newest shape (autotuning_sizes_noted)
tuning_sizes: dict[str, int] = {}
_UNTIMED = {"active": False}  # inside untimed_autotuning


@patch(TRITON, _PRUNE)
def autotuning_sizes_noted() -> None:
    """Note, per kernel, how many configurations Triton's autotuner is about to compile and time.

    Upstream: for a shape it has no choice for, the autotuner compiles and benchmarks every
    configuration ``prune_configs`` leaves, silently; a first step can spend minutes there.
    flame: the count is kept in ``tuning_sizes`` under the kernel's name, so that the log's compile
    watch (flame.base.compile_watch.CompileWatch) can say "configuration 4 of 32, about 50 s left".
    Applied with the watch, on GPUs (flame.train, and the job's check for its memory-plan probe).
    """
    autotuner = importlib.import_module(_PRUNE.module).Autotuner
    prune_configs = autotuner.prune_configs

    def noted(self, kwargs):
        configs = prune_configs(self, kwargs)
        tuning_sizes[self.base_fn.__name__] = 1 if _UNTIMED["active"] else len(configs)  # untimed: the first that runs
        return configs

    autotuner.prune_configs = noted


# the autotuner's tunings that compile this long or longer are said in the log
SAID_AFTER_S = 5.0


COMPILE_THREADS = "FLAME_COMPILE_THREADS"  # how many threads a rank compiles an autotuner's configurations on (1: off)


def compile_threads() -> int:
    """Threads for one rank's side-by-side compiles: ``FLAME_COMPILE_THREADS`` where set, else its share of the CPUs
    it may run on, less one for the thread that launches the GPU's work."""
    if asked := os.environ.get(COMPILE_THREADS, "").strip():
        if not asked.isdigit() or int(asked) < 1:
            raise ConfigError(f"{COMPILE_THREADS}={asked}: give a number of threads, 1 or more (1: compile one after "
                              "another, as Triton does), or unset it for the rank's share of the CPUs")
        return int(asked)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1)


@patch(TRITON, _PRUNE, Target(TRITON, "triton.runtime.autotuner", "Autotuner._bench", ("self",)),
       Target(TRITON, "triton.runtime._async_compile", "AsyncCompileMode.__init__", ("self", "executor")))
def configurations_compiled_together(threads: int) -> None:
    """Compile every configuration an autotuner is about to time at once, on ``threads`` threads, before it times them.

    Upstream: for a key with no cached choice, the autotuner compiles and times its configurations one after another,
    each compile on the calling thread (fla rwkv7's step 1 compiled 334 kernels in 158 s on an H100, most of them
    configurations of a few kernels: 135 for ``chunk_dplr_bwd_kernel_dv``). flame: at the first timing of a new key,
    all the configurations ``prune_configs`` left are compiled side by side through Triton's own asynchronous compile
    (``AsyncCompileMode``: Triton compiles without holding the GIL, 40 fla kernels took 7.9 s on 2 threads against
    14.6 s on one), then timed as upstream times them, each taken from the kernel cache; the chosen configuration
    and the timings are upstream's. A configuration that fails to compile is compiled again, and fails, at its timing,
    which scores it as upstream does. Tunings that compiled for ``SAID_AFTER_S`` or longer are said in the log.
    Inactive under ``untimed_autotuning`` (the memory plan's probe, which compiles one configuration a kernel). Applied
    in every GPU rank whose share of the CPUs leaves two threads or more (flame.train).
    """
    module = importlib.import_module(_PRUNE.module)
    from triton.runtime._async_compile import AsyncCompileMode

    autotuner = module.Autotuner
    prune_configs, bench = autotuner.prune_configs, autotuner._bench
    executor = ThreadPoolExecutor(threads, thread_name_prefix="flame-triton-compile")

    def pruned(self, kwargs):
        configs = prune_configs(self, kwargs)
        self._flame_to_compile = configs  # a new key: compiled together at its first timing
        return configs

    def compile_first(self, *args, config, **meta):
        configs = self.__dict__.pop("_flame_to_compile", None)
        if configs is not None and len(configs) > 1 and not _UNTIMED["active"]:
            start = time.monotonic()
            with AsyncCompileMode(executor, ignore_errors=True):  # on leaving, every compile is done and cached
                for each in configs:
                    with contextlib.suppress(Exception):  # raised again where upstream times it
                        self.fn.run(*args, **{**meta, **each.all_kwargs(), "warmup": True})
            if (took := time.monotonic() - start) >= SAID_AFTER_S:
                logging.getLogger().info(
                    f"Triton autotuning {self.base_fn.__name__}: compiled its {len(configs)} configurations in "
                    f"{took:.0f} s on {threads} threads; timing them now (Triton's cache keeps the choice)")
        return bench(self, *args, config=config, **meta)

    autotuner.prune_configs, autotuner._bench = pruned, compile_first


def compile_watch() -> CompileWatch:
    """flame.base.compile_watch.CompileWatch for this process, told how many configurations each kernel tunes."""
    autotuning_sizes_noted()
    return CompileWatch(tuning_sizes)


_BENCH = Target(TRITON, "triton.runtime.autotuner", "Autotuner._bench", ("self",))
_DISK_CACHE = Target(TRITON, "triton.runtime.autotuner", "Autotuner.check_disk_cache",
                     ("self", "tuning_key", "configs", "bench_fn"))
_NOT_TIMED = [0.0, 0.0, 0.0]  # what _bench returns: the median and the 20% and 80% quantiles, in ms
_FAILED = [float("inf")] * 3


class _NoChoiceCached(Exception):
    """Raised in place of Triton's benchmark to learn that no choice is cached for a kernel's key."""


def _no_choice_cached() -> None:
    raise _NoChoiceCached


@patch(TRITON, _PRUNE, _BENCH, _DISK_CACHE)
def first_config_where_untimed() -> None:
    """Let ``untimed_autotuning`` skip the benchmarks of kernels with no choice cached (installed once, inactive
    outside that block).

    Upstream: an autotuned kernel called with a key it has no choice for compiles and times every
    configuration (135 for fla rwkv7's ``chunk_dplr_bwd_kernel_dv``) and writes the winner to Triton's cache.
    flame, inside the block: a choice cached on disk is read as upstream reads it; without one the configurations
    are tried in order, each compiled and run once, untimed, until one runs (those that fail to compile are passed
    over as upstream passes them over), and that one is used without being written to the cache, so no later run
    reads it as a measured choice.
    """
    autotuner = importlib.import_module(_BENCH.module).Autotuner
    prune_configs, bench, check_disk_cache = autotuner.prune_configs, autotuner._bench, autotuner.check_disk_cache

    def pruned(self, kwargs):
        self._flame_ran_one = False  # a new key: its benchmark starts over
        return prune_configs(self, kwargs)

    def first_that_runs(self, *args, config, **meta):
        if not _UNTIMED["active"]:
            return bench(self, *args, config=config, **meta)
        if getattr(self, "_flame_ran_one", False):
            return _FAILED  # one ran already: the rest are neither compiled nor run
        self.__dict__["do_bench"] = lambda kernel_call, quantiles: (kernel_call(), _NOT_TIMED)[1]
        try:
            result = bench(self, *args, config=config, **meta)
        finally:
            self.__dict__.pop("do_bench")  # Triton's own (a cached property) again
        self._flame_ran_one = result is _NOT_TIMED
        return result

    def read_only(self, tuning_key, configs, bench_fn):
        if not _UNTIMED["active"]:
            return check_disk_cache(self, tuning_key, configs, bench_fn)
        try:
            return check_disk_cache(self, tuning_key, configs, _no_choice_cached)  # upstream reads a cached choice
        except _NoChoiceCached:  # upstream would benchmark, then write: only the first that runs, nothing written
            bench_fn()
            return False

    autotuner.prune_configs, autotuner._bench, autotuner.check_disk_cache = pruned, first_that_runs, read_only


@contextlib.contextmanager
def untimed_autotuning() -> Iterator[None]:
    """Within the block, a Triton kernel autotuned for a key with no cached choice runs its first configuration that
    compiles, untimed, and caches no choice (``first_config_where_untimed``): for runs that measure memory, not
    speed (the memory plan's GPU probe), which then compile one configuration a kernel instead of every one."""
    first_config_where_untimed()
    _UNTIMED["active"] = True
    try:
        yield
    finally:
        _UNTIMED["active"] = False


class KernelLaunchRefused(RuntimeError):
    """A Triton kernel was launched where ``kernel_launches_refused`` forbids it (the message names it)."""


@contextlib.contextmanager
def kernel_launches_refused() -> Iterator[None]:
    """Within the block, launching any Triton kernel (``kernel[grid](...)``) raises ``KernelLaunchRefused``.

    For forwards on meta tensors (the memory plan's activation measurement): a kernel launched
    there gets null pointers. On a CPU Triton refuses it, but on a GPU it runs and its illegal
    memory accesses poison the CUDA context of the process, which then fails in whatever CUDA
    call comes next (seeding the trainer's RNG). Every launch goes through
    ``KernelInterface.__getitem__`` (``JITFunction``, the autotuner and heuristics wrappers alike).
    """
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:  # no Triton (macOS): nothing can launch
        yield
        return
    launch = KernelInterface.__getitem__

    def refuse(kernel, grid):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "a kernel")
        raise KernelLaunchRefused(f"Triton kernel {name}")

    KernelInterface.__getitem__ = refuse
    try:
        yield
    finally:
        KernelInterface.__getitem__ = launch
