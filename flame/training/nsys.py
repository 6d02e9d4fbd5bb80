"""A step window for Nsight Systems: cudaProfilerStart/Stop around it, NVTX ranges inside every step.

With ``--profiling.nsys_start_step N --profiling.nsys_stop_step M``, capture starts before step
N and stops after step M-1, and every step is marked by NVTX ranges: ``step <n>`` around the
whole step, inside it ``data`` (the step's batches), ``forward`` and ``backward`` (per
micro-batch; one ``forward_backward`` per step under pipeline parallelism, whose schedule
interleaves them) and ``optimizer`` (gradient clipping, the update, the LR step). Run under
``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop``, the report then
holds those steps only. The GPU is synchronized at both ends, so the window holds the
kernels of its own steps. On CPU, and without the flags, all of it does nothing.
"""

import contextlib
from collections.abc import Iterator

import torch

from flame.base import device


class NsysWindow:
    """cudaProfilerStart/Stop around steps ``start``..``stop - 1``; NVTX ranges while enabled."""

    def __init__(self, start: int | None, stop: int | None):
        self.enabled = device.CUDA and start is not None
        self.start, self.stop = start, stop
        self.capturing = False

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: starts the capture at its first step, stops it after its last."""
        if not self.enabled:
            yield
            return
        if step == self.start:
            torch.cuda.synchronize()  # earlier steps' kernels stay out of the window
            torch.cuda.profiler.start()
            self.capturing = True
        try:
            with torch.cuda.nvtx.range(f"step {step}"):
                yield
        finally:
            if step == self.stop - 1:
                self.close()

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """An NVTX range named ``name`` while the window is enabled, else nothing."""
        return torch.cuda.nvtx.range(name) if self.enabled else contextlib.nullcontext()

    def push(self, name: str) -> None:
        """Open an NVTX range named ``name`` (closed by ``pop``) while the window is enabled."""
        if self.enabled:
            torch.cuda.nvtx.range_push(name)

    def pop(self) -> None:
        if self.enabled:
            torch.cuda.nvtx.range_pop()

    def close(self) -> None:
        """Stop the capture (after the window's last step, or when training ends inside the window)."""
        if self.capturing:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self.capturing = False
