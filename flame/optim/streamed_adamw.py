"""The optimizer of a streamed model (--memory.stream_weights, flame.optim.streaming): AdamW or Adam over its
float32 masters on the host, stepped unit by unit on the stream's host thread while the next forward runs, and
torchtitan's container of it. Its groups and state are torch's AdamW's, over the model's own parameters: a
checkpoint resumes with streaming on or off."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.optim import Adam, AdamW, Optimizer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flame.distributed.parallelize import StreamedDtypes
from flame.optim import groups
from flame.optim.host import by_hyperparameters, fused_adam, local_part
from flame.optim.host_worker import SettlesFirst
from flame.optim.stream_units import Unit
from flame.optim.streaming import WeightStream

REPORTED_AT = (3, 10, 100, 1000)  # steps whose start logs the host step's cost so far (then every 1000th)


class StreamedAdamW(SettlesFirst, Optimizer):
    """AdamW (``decoupled``) or Adam over the model's masters, stepped on the host unit by unit while the next
    forward runs (``WeightStream``). Its groups and state are torch's AdamW's, over the model's own parameters."""

    def __init__(self, model: nn.Module, stream: WeightStream, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool = True, param_groups: list[dict] | None = None):
        params = [p for p in model.parameters() if p.requires_grad]
        like = (AdamW if decoupled else Adam)([torch.zeros(1, requires_grad=True)], lr=lr, betas=betas, eps=eps,
                                               weight_decay=weight_decay, fused=True)
        super().__init__(param_groups or params, like.defaults)
        self.stream, self.decoupled = stream, decoupled
        # AdamW's state for every parameter from the start (zeros, as AdamW's first step makes it): a checkpoint
        # saved or loaded before the first step has the same entries as any other
        for group in self.param_groups:
            for master in group["params"]:
                self.state[master] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
        self.max_norm = 0.0
        self.norm: torch.Tensor | None = None
        self.stepping = 0.0  # seconds the host spent in AdamW, all steps together
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A new step's gradients start from none (the trainer calls it first in every step)."""
        self.stream.begin_step(self.stream.passes_expected)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The step's gradient norm; the update scales the gradients to ``max_norm`` where they exceed it."""
        self.max_norm, self.norm = max_norm, self.stream.gradient_norm()
        return self.norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("--memory.stream_weights steps without a closure")
        self.settle()
        self.steps += 1
        if self.steps in REPORTED_AT or self.steps % REPORTED_AT[-1] == 0:  # the last steps' updates are done
            done = self.steps - 1
            logger.info(f"Weight streaming: AdamW took {self.stepping / done:.3f} s a step on the host; the forward "
                        f"waited {self.stream.waited / done:.3f} s a step for it (steps 1-{done})")
        scale = 1.0
        if self.max_norm > 0 and self.norm is not None:  # torch's clip_grad_norm_ rule
            scale = min(1.0, self.max_norm / (float(self.norm) + 1e-6))
        settings = {id(p): group for group in self.param_groups for p in group["params"]}
        summed = self.stream.passes_expected > 1
        for unit in self.stream.units:
            if not unit.passes:
                continue  # no gradient reached it this step: AdamW leaves it as it is
            groups = by_hyperparameters(unit.masters, list(unit.grad_offsets), settings)
            unit.stepped.clear()
            unit.current = unit.current and not unit.resident  # its buffer holds the old weights
            self.stream.host.put(lambda unit=unit, groups=groups: self._update(unit, groups, scale, summed))
        self.norm = None

    def _update(self, unit: Unit, groups: dict[tuple, list[int]], scale: float, summed: bool) -> None:
        """(host thread) One unit's AdamW update of its masters; clipping's ``scale`` applied by the fused kernel as
        it reads the gradients (no pass of its own)."""
        start = time.perf_counter()
        grads = unit.grad_views(self.stream.gradients(unit, summed))
        unscale = torch.tensor(1.0 / scale) if scale != 1.0 else None
        for hyper, indices in groups.items():
            fused_adam(self.decoupled, hyper, [local_part(unit.masters[i]) for i in indices], [grads[i] for i in indices],
                       [self.state[unit.masters[i]] for i in indices], grad_scale=unscale)
        self.stepping += time.perf_counter() - start
        unit.stepped.set()

    def settle(self) -> None:
        """The last step's updates done: before a checkpoint reads the masters or the state, and before the next."""
        self.stream.host.drain()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.stream.mark_stale()


class StreamedOptimizersContainer(SettlesFirst, OptimizersContainer):
    """torchtitan's container of the one StreamedAdamW of a streamed model (one model part; over several processes,
    ``mesh``, each streams its shards)."""

    def __init__(self, model_parts: list[nn.Module], kwargs: dict, decoupled: bool, dtypes: StreamedDtypes,
                 device: torch.device, optimizer_config: Any = None, mesh=None) -> None:
        self.model_parts = model_parts
        (model,) = model_parts
        self.stream = WeightStream(model, dtypes.compute, device, mesh=mesh, reduce_dtype=dtypes.reduce)
        parts = groups.groups_of(model, optimizer_config) if optimizer_config is not None else []
        if parts:
            logger.info(f"Parameter groups ({optimizer_config.name}, streamed): "
                        f"{groups.describe(parts, kwargs['lr'], optimizer_config)}")
        self.optimizers = [StreamedAdamW(model, self.stream, **kwargs, decoupled=decoupled,
                                         param_groups=[g.torch_group(kwargs["lr"]) for g in parts])]
        self._validate_length(1)
        self._post_init([p for group in self.optimizers[0].param_groups for p in group["params"]], kwargs)

    def begin_step(self, passes: int) -> None:
        self.stream.begin_step(passes)

    def graded(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s streamed twin has had a gradient (its own ``.grad`` stays empty)."""
        return id(param) in self.stream.graded

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.optimizers[0].clip_grad_norm_(max_norm)

    def settle(self) -> None:
        self.optimizers[0].settle()
