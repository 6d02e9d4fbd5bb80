"""Checkpointed blocks' inputs in host memory between the forward and the backward (--activation_checkpoint.offload).

Under full activation checkpointing a decoder block keeps only its input for the backward, which recomputes the
block from it: at 32K tokens a row, hidden 4096 and bf16, 256 MB a block, all of them alive from the forward to
the backward. With this option each checkpointed block's input goes to the host as soon as the block has run and
comes back one block ahead of its backward:
- forward: after block i runs, its input is copied to pinned host memory on a copy stream; once the next block has
  run too (the copy has had a block's time), the GPU storage of block i's input is released;
- backward: when the gradient reaches block i + 1's output (its backward is about to start), block i's input is
  copied back on the copy stream into a fresh storage; block i's own backward waits for that copy.
The tensor the checkpoint's recompute holds is the same one: only its storage leaves and comes back (with a
tensor of its own doing the copy, so its version does not change). The last checkpointed block keeps its input:
its backward follows its forward at once. On a CPU-only run the host copy is a CPU copy: the same steps.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.tools.logging import logger


class _Parked:
    """One block's input while it waits on the host: the tensor, its host copy, and the copies' events."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # the copy to the host (CUDA)
        self.back: torch.cuda.Event | None = None  # the copy back (CUDA)
        self.released = False


class InputOffload:
    """The hooks that park the inputs of the first ``count`` of ``blocks`` (the model's decoder blocks, in forward
    order) on the host; every block's forward releases the parked input of the one before it."""

    def __init__(self, blocks: list[nn.Module], count: int) -> None:
        self.count = count
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.parked: list[_Parked | None] = [None] * len(blocks)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, kwargs, index=index: self._before(index, args, kwargs),
                                            with_kwargs=True)
            block.register_forward_hook(lambda module, args, output, index=index: self._after(index, output))

    def _before(self, index: int, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        wanted = index < self.count and torch.is_grad_enabled() and _owns_storage(hidden)  # no backward: nothing kept
        self.parked[index] = _Parked(hidden) if wanted else None

    def _after(self, index: int, output) -> None:
        if index > 0:
            self._release(index - 1)  # a block later: its copy to the host has had this block's time
        parked = self.parked[index]
        out = output[0] if isinstance(output, tuple) else output
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            self.parked[index] = None  # no backward will come through this block's output: nothing to park
            return
        if parked is None:
            if index == self.count:  # the first block kept whole: its backward starts the last parked input back
                out.register_hook(lambda grad, index=index: self._backward_reaches(index))
            return
        parked.host = torch.empty(parked.tensor.shape, dtype=parked.tensor.dtype, pin_memory=self.cuda)
        parked.copied = self._copy(parked.host, parked.tensor)
        # the gradient of the block's output comes just before its backward, which recomputes it from its input
        out.register_hook(lambda grad, index=index: self._backward_reaches(index))

    def _release(self, index: int) -> None:
        parked = self.parked[index]
        if parked is None or parked.host is None or parked.released:
            return
        if parked.copied is not None:
            parked.copied.synchronize()
        parked.tensor.untyped_storage().resize_(0)
        parked.released = True

    def _backward_reaches(self, index: int) -> None:
        """Block ``index``'s backward is about to run: its input must be back, and the one before it starts back."""
        self._restore(index, wait=True)
        if index > 0:
            self._restore(index - 1, wait=False)

    def _restore(self, index: int, wait: bool) -> None:
        parked = self.parked[index]
        if parked is None:
            return
        if parked.released:
            tensor = parked.tensor
            storage = tensor.untyped_storage()
            storage.resize_(tensor.numel() * tensor.element_size())
            into = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape, tensor.stride())
            parked.back = self._copy(into, parked.host)
            parked.released = False
        if wait:
            if parked.back is not None:
                torch.cuda.current_stream().wait_event(parked.back)
            self.parked[index] = None  # its host copy goes with it

    def _copy(self, into: torch.Tensor, source: torch.Tensor):
        """``source`` into ``into``: on a GPU on the copy stream, after what the compute stream has queued (the
        block's last read of its input, or the storage's allocation), with the event of its end; else at once."""
        if not self.cuda:
            into.copy_(source)
            return None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            into.copy_(source, non_blocking=True)
            return self.stream.record_event()


def _owns_storage(tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage (a block's fresh input), so that releasing the storage releases
    nothing else."""
    return (isinstance(tensor, torch.Tensor) and tensor._base is None and tensor.is_contiguous()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def offload_inputs(layers: nn.ModuleList, count: int) -> InputOffload | None:
    """Park the inputs of the first ``count`` blocks (the checkpointed ones) on the host; the model's last block
    keeps its input (its backward comes first)."""
    count = min(count, len(layers) - 1)
    if count <= 0:
        return None
    logger.info(f"Inputs of {count} checkpointed blocks wait in host memory between the forward and the backward "
                "(--activation_checkpoint.offload)")
    return InputOffload(list(layers), count)
