"""An exponential moving average of the trained weights (--training.ema_decay), for evaluation and export.

After every update the average moves toward the weights: ``ema = decay x ema + (1 - decay) x weights``, in fp32.
The average lives beside the weights and is placed like them: a copy of each trainable parameter (under FSDP its
local shard, under TP its slice: a DTensor's copy is a DTensor on the same mesh), so it costs 4 bytes a parameter
of this rank's share and one fused lerp per step, and needs no communication. It is part of the checkpoint (its
own state, flame.checkpoint.steps.EMA_STATE: ema.<parameter name> in DCP's files), so a resume continues it exactly; a checkpoint saved without it starts it from the loaded
weights (logged). Validation scores it beside the live weights (``validation/ema_*``, with the weights swapped in
place for the pass), and ``python -m flame.utils.convert_dcp_to_hf --ema`` exports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from flame.optim.groups import clean_name
from flame.optim.host import local_part


class WeightAverage(Stateful):
    """The EMA of ``model_parts``' trainable parameters."""

    def __init__(self, model_parts: list[nn.Module], decay: float):
        self.decay = decay
        named = {}
        for part in model_parts:
            for name, param in part.named_parameters():
                if param.requires_grad:
                    named[clean_name(name)] = param
        self.names, self.params = list(named), list(named.values())
        self.average = [param.detach().clone().float() for param in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average toward the current weights."""
        weights = [param.detach() if param.dtype == torch.float32 else param.detach().float() for param in self.params]
        torch._foreach_lerp_(self.average, weights, 1 - self.decay)

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average at the current weights (a checkpoint saved without one)."""
        for average, param in zip(self.average, self.params):
            average.copy_(param.detach())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.average))

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, average in zip(self.names, self.average):
                if state_dict[name] is not average:  # DCP loads in place; a plain dict is copied
                    average.copy_(state_dict[name])

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the parameters' place while the block runs, the weights back after. The weights wait in host
        memory meanwhile (this rank's shards), so scoring the average costs the GPU no second copy of the model."""
        with torch.no_grad():
            kept = [local_part(param).detach().to("cpu", copy=True) for param in self.params]
            for param, average in zip(self.params, self.average):
                param.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, weights in zip(self.params, kept):
                    local_part(param).copy_(weights)
