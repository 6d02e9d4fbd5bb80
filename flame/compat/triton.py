"""triton's seam: how Triton's autotuner waits for its benchmarks under pipeline parallelism, how
many configurations it is about to try, and forwards in which no kernel may launch.

Written for triton 3.6.0 (3rdparty/requirements.txt).
"""

import contextlib
import importlib
from collections.abc import Iterator

import torch

from flame.base.triton_kernels import CompileWatch
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


@patch(TRITON, _PRUNE)
def autotuning_sizes_noted() -> None:
    """Note, per kernel, how many configurations Triton's autotuner is about to compile and time.

    Upstream: for a shape it has no choice for, the autotuner compiles and benchmarks every
    configuration ``prune_configs`` leaves, silently; a first step can spend minutes there.
    flame: the count is kept in ``tuning_sizes`` under the kernel's name, so that the log's compile
    watch (flame.base.triton_kernels.CompileWatch) can say "configuration 4 of 32, about 50 s left".
    Applied with the watch, on GPUs (flame.train, and the job's check for its memory-plan probe).
    """
    autotuner = importlib.import_module(_PRUNE.module).Autotuner
    prune_configs = autotuner.prune_configs

    def noted(self, kwargs):
        configs = prune_configs(self, kwargs)
        tuning_sizes[self.base_fn.__name__] = len(configs)
        return configs

    autotuner.prune_configs = noted


def compile_watch() -> CompileWatch:
    """flame.base.triton_kernels.CompileWatch for this process, told how many configurations each kernel tunes."""
    autotuning_sizes_noted()
    return CompileWatch(tuning_sizes)


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
