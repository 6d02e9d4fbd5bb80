"""What a streamed model moves together (flame.optim.streaming): a ``Unit`` is a decoder block's weights, or the
rest of the model's, with where each of its parameters lives on the host (pinned buffers, one a dtype), on the GPU
(one buffer in the compute dtype) and in the landing of its gradients, and the state of its copies.

Over several processes each holds a *shard* of every parameter on its host: dim 0 split in equal chunks, the last
ones padded (FSDP's split, and DTensor's ``Shard(0)``: checkpoints reshard to any layout). A unit's shards lie one
after another in the *shard layout*, ``chunk`` elements a parameter; the ranks' shard layouts side by side are what
the all-gather gives and the reduce-scatter takes (one process: the shard is the parameter, the layouts one)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_WRAPPED = ("_checkpoint_wrapped_module", "_orig_mod")  # activation checkpointing's and torch.compile's wrappers


def innermost(module: nn.Module) -> nn.Module:
    """The block a wrapper calls: its forward runs again in activation checkpointing's recompute."""
    while any(hasattr(module, name) for name in _WRAPPED):
        module = next(getattr(module, name) for name in _WRAPPED if hasattr(module, name))
    return module


@dataclass(eq=False)
class Unit:
    """Weights the forward needs together: a decoder block's, or (``resident``) the rest of the model's."""

    name: str
    masters: list[torch.Tensor]  # the model's parameters (host; float32, LoRA's frozen base its own dtype), each once
    places: list[list[tuple[nn.Module, str]]]  # where each master sits (a tied one: twice)
    resident: bool = False  # its GPU buffer stays allocated between the passes
    offsets: list[int] = field(default_factory=list)  # each master's place in the GPU buffer (elements)
    numel: int = 0
    ranks: int = 1  # the processes sharing the unit, each holding a shard
    rank: int = 0
    chunks: list[int] = field(default_factory=list)  # each master's shard in the shard layout, padded (elements)
    local_shapes: list[torch.Size] = field(default_factory=list)  # each master's rows on this rank (its shard)
    shard_offsets: list[int] = field(default_factory=list)  # each master's place in the shard layout
    shard_numel: int = 0
    # the masters' shards by dtype, each group's in one pinned buffer (what goes up): (first and end shard offsets,
    # buffer)
    flats: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    grad_offsets: dict[int, int] = field(default_factory=dict)  # a trainable master's place in ``landing``
    grad_numel: int = 0  # the trainable masters' chunks: a rank's share of the reduce-scattered gradients
    landing: torch.Tensor | None = None  # host (pinned), compute dtype, flat: this rank's gradients that came down
    summed: torch.Tensor | None = None  # host, float32, flat: the gradients summed over micro-batches
    storage: Any = None  # the GPU buffer (empty while released)
    leaves: list[torch.Tensor] = field(default_factory=list)  # the masters' GPU twins, views of ``storage``
    current: bool = False  # the GPU buffer holds the masters' weights
    fetched: Any = None  # CUDA event: the copy up is done (until the compute stream waited for it)
    landed: Any = None  # CUDA event: the gradients reached ``landing``
    stepped: threading.Event = field(default_factory=threading.Event)  # the masters hold the step's weights
    added: threading.Event = field(default_factory=threading.Event)  # the host is done reading ``landing``
    passes: int = 0  # backward passes whose gradients came down, this step
    seen: int = 0  # leaves whose gradients this pass has made
    in_backward: bool = False
    squares: float = 0.0  # micro-batches: the summed gradients' squared norm (host)

    @property
    def trainable(self) -> int:
        return len(self.grad_offsets)

    def layout(self, ranks: int = 1, rank: int = 0) -> None:
        """The masters' places: in the GPU buffer and in the shard layout, each dtype's together (a group goes up
        in one copy), and the trainable ones' in the landing; ``rank``'s shards of ``ranks``."""
        order = {dtype: index for index, dtype in enumerate(dict.fromkeys(master.dtype for master in self.masters))}
        pairs = sorted(zip(self.masters, self.places), key=lambda pair: order[pair[0].dtype])
        self.masters, self.places = [master for master, _ in pairs], [places for _, places in pairs]
        self.ranks, self.rank = ranks, rank
        offset = shard_offset = grads = 0
        for index, master in enumerate(self.masters):
            shape = master.shape if ranks == 1 else shard_shape(master.shape, ranks, rank)
            chunk = chunk_numel(master.shape, ranks)
            self.offsets.append(offset)
            self.shard_offsets.append(shard_offset)
            self.chunks.append(chunk)
            self.local_shapes.append(shape)
            offset += master.numel()
            shard_offset += chunk
            if master.requires_grad:
                self.grad_offsets[index] = grads
                grads += chunk
        self.numel, self.shard_numel, self.grad_numel = offset, shard_offset, grads

    def groups(self) -> list[tuple[torch.dtype, int, int]]:
        """(dtype, first offset, end offset) of each dtype's masters in the shard layout."""
        bounds: dict[torch.dtype, list[int]] = {}
        for master, offset, chunk in zip(self.masters, self.shard_offsets, self.chunks):
            bounds.setdefault(master.dtype, [offset, offset])[1] = offset + chunk
        return [(dtype, start, end) for dtype, (start, end) in bounds.items()]

    def host_views(self) -> list[torch.Tensor]:
        """Each master's shard in its group's pinned buffer (the rows this rank holds)."""
        views = []
        for offset, shape in zip(self.shard_offsets, self.local_shapes):
            start, _, flat = next(group for group in self.flats if group[0] <= offset < group[1])
            views.append(flat[offset - start : offset - start + shape.numel()].view(shape))
        return views

    def grad_views(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """A trainable master's gradient shard in ``flat`` (the landing, or a float32 copy of it), by its index."""
        return {index: flat[start : start + self.local_shapes[index].numel()].view(self.local_shapes[index])
                for index, start in self.grad_offsets.items()}


def shard_shape(shape: torch.Size, ranks: int, rank: int) -> torch.Size:
    """The rows of dim 0 ``rank`` holds of ``ranks`` (torch.chunk's split: equal chunks, rounded up; the last ranks
    get fewer or none)."""
    rows = -(-shape[0] // ranks)
    return torch.Size([max(0, min(rows, shape[0] - rank * rows)), *shape[1:]])


def chunk_numel(shape: torch.Size, ranks: int) -> int:
    """A rank's share of a parameter of ``shape`` with the padding, FSDP's: the first rank's rows (a scalar whole)."""
    return shard_shape(shape, ranks, 0).numel() if ranks > 1 and len(shape) else shape.numel()

