"""Pinned host memory: what PyTorch's pinned allocator takes for a tensor, and flame's own pinned buffers without
its rounding.

PyTorch's caching host allocator rounds every pinned (page-locked) allocation up to the next power of two, to
reuse freed blocks by size (torch 2.11 has no setting for it). A 7B block's float32 MLP weight (4096 x 11008,
172 MiB) takes 256 MiB: FSDP's CPU offload pins each weight and each gradient so, a third more than they hold,
which the memory plan counts (``allocated``). flame's own pinned buffers (the host optimizer's copies of the
weights and gradients) come from ``HostArena``: chunks of a power of two bytes, which the allocator gives
exactly, handed out tensor by tensor; only each chunk's tail, where the next tensor did not fit, goes unused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK_BYTES = 1 << 30  # one pinned allocation of the arena; a tensor larger than it is pinned alone
FLOAT32 = 4


def allocated(nbytes: int) -> int:
    """The bytes PyTorch's pinned allocator takes for ``nbytes``: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def chunk_bytes_for(total_bytes: int) -> int:
    """The arena's chunk for buffers of ``total_bytes`` in all: a small job's whole need, rounded, not 1 GiB."""
    return min(CHUNK_BYTES, max(allocated(total_bytes), FLOAT32))


def least_wasting_chunk(numels: list[int]) -> int:
    """The chunk (a power of two, 64 MiB to 8 GiB) whose arena takes the fewest bytes for fp32 tensors of these
    element counts: buffers of a few hundred MB (a 7B block's) waste a quarter of 1 GiB chunks, 1% of 8 GiB ones."""
    return min((arena_bytes(numels, 1 << bits), 1 << bits) for bits in range(26, 34))[1]


def arena_bytes(numels: Iterable[int], chunk_bytes: int = CHUNK_BYTES) -> int:
    """The pinned bytes a ``HostArena`` takes for fp32 tensors of these element counts, asked for in this order."""
    arena, alone = HostArena(pin=True, chunk_bytes=chunk_bytes), 0
    for numel in numels:
        if arena.place(numel) is None:
            alone += allocated(FLOAT32 * numel)
    return len(arena.used) * chunk_bytes + alone


class HostArena:
    """fp32 host tensors carved out of pinned chunks of ``chunk_bytes``, each in the first chunk with room for it
    (plain host memory when ``pin`` is off: a CPU run, where host and device are one memory)."""

    def __init__(self, pin: bool, chunk_bytes: int = CHUNK_BYTES):
        self.pin, self.chunk_elements = pin, chunk_bytes // FLOAT32
        self.chunks: list[torch.Tensor] = []
        self.used: list[int] = []  # elements handed out of each chunk, opened or to open

    def place(self, numel: int) -> tuple[int, int] | None:
        """(chunk, start) of the next tensor of ``numel`` elements, a new chunk where none has room; None for one
        larger than a chunk, pinned alone (or empty)."""
        if numel == 0 or numel > self.chunk_elements:
            return None
        chunk = next((i for i, used in enumerate(self.used) if used + numel <= self.chunk_elements), len(self.used))
        if chunk == len(self.used):
            self.used.append(0)
        start, self.used[chunk] = self.used[chunk], self.used[chunk] + numel
        return chunk, start

    def take(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (a narrower one takes its bytes in whole float32 elements)."""
        nbytes = shape.numel() * dtype.itemsize
        numel = -(-nbytes // FLOAT32)
        place = self.place(numel) if self.pin else None
        if place is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        chunk, start = place
        if chunk == len(self.chunks):
            self.chunks.append(torch.empty(self.chunk_elements, dtype=torch.float32, pin_memory=True))
        return self.chunks[chunk][start : start + numel].view(torch.uint8)[:nbytes].view(dtype).view(shape)
