"""What a streamed model moves together (flame.optim.streaming): a ``Unit`` is a decoder block's weights, or the
rest of the model's, with where each of its parameters lives on the host (pinned buffers, one a dtype), on the GPU
(one buffer in the compute dtype) and in the landing of its gradients, and the state of its copies."""

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
    # the masters by dtype, each group's in one pinned buffer (what goes up): (its first and end offsets, buffer)
    flats: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    grad_offsets: dict[int, int] = field(default_factory=dict)  # a trainable master's place in ``landing``
    grad_numel: int = 0
    landing: torch.Tensor | None = None  # host (pinned), compute dtype, flat: the gradients that came down
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

    def layout(self) -> None:
        """The masters' places: in the GPU buffer, each dtype's together (a group goes up in one copy), and the
        trainable ones' in the landing."""
        order = {dtype: rank for rank, dtype in enumerate(dict.fromkeys(master.dtype for master in self.masters))}
        pairs = sorted(zip(self.masters, self.places), key=lambda pair: order[pair[0].dtype])
        self.masters, self.places = [master for master, _ in pairs], [places for _, places in pairs]
        self.offsets, offset, grads = [], 0, 0
        for index, master in enumerate(self.masters):
            self.offsets.append(offset)
            offset += master.numel()
            if master.requires_grad:
                self.grad_offsets[index] = grads
                grads += master.numel()
        self.numel, self.grad_numel = offset, grads

    def groups(self) -> list[tuple[torch.dtype, int, int]]:
        """(dtype, first offset, end offset) of each dtype's masters in the GPU buffer."""
        bounds: dict[torch.dtype, list[int]] = {}
        for master, offset in zip(self.masters, self.offsets):
            bounds.setdefault(master.dtype, [offset, offset])[1] = offset + master.numel()
        return [(dtype, start, end) for dtype, (start, end) in bounds.items()]

    def host_views(self) -> list[torch.Tensor]:
        """Each master's place in its group's pinned buffer."""
        views = []
        for master, offset in zip(self.masters, self.offsets):
            start, _, flat = next(group for group in self.flats if group[0] <= offset < group[1])
            views.append(flat[offset - start : offset - start + master.numel()].view(master.shape))
        return views

    def grad_views(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """A trainable master's gradient in ``flat`` (the landing, or a float32 copy of it), by its index."""
        return {index: flat[start : start + self.masters[index].numel()].view(self.masters[index].shape)
                for index, start in self.grad_offsets.items()}
