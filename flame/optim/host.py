"""AdamW (or Adam) whose state lives and steps in host memory while the next forward runs (--optimizer.on_host).

Why: under mixed precision a parameter costs the GPU 16 bytes (fp32 weight, fp32 gradient, and
AdamW's two fp32 moments). The moments are half of it, and they are only read once a step, by the
update. Kept on the host, they free that half; FSDP2's CPU offload (--training.enable_cpu_offload)
frees all of it but copies every weight up for every pass.

How a step runs on a GPU:
1. ``step`` (after the backward and the gradient clipping) queues the copy of every gradient into
   pinned host memory on a copy stream, unit by unit, and returns at once. The pinned copies of the
   weights and gradients come from ``flame.optim.pinned.HostArena``'s chunks, which PyTorch's pinned
   allocator does not round up to a power of two (one buffer a block took a third more than it held).
2. A host thread steps each unit with torch's fused CPU AdamW on the host's fp32 copy of its
   weights (on all cores but one, left to the thread launching the GPU's work), then queues the
   new weights' copy to the GPU on a second stream. The units come in the order the next forward
   needs them (``units_of``): the embeddings, each decoder block, then the final norm and head.
3. The next forward waits, before each unit, for that unit's weights (a forward pre-hook, ahead
   of FSDP's gather): block 3 computes while block 4 steps on the host.

The host's AdamW is slower than the forward it hides behind (memory-bound, about 4-5 G parameters
a second: fla transformer 1B's forward waited 0.12-0.15 s a step; docs/perf-log.md, 2026-11-27).
``gpu_blocks`` (--optimizer.gpu_blocks K) keeps the state of the units up to the K-th decoder
block on the GPU, stepped there by the same fused AdamW right after the backward: the host starts
on the blocks the forward reaches later, with the first K blocks' forward as its head start.

With --training.enable_cpu_offload as well (weight streaming), FSDP2 keeps the float32 weights and their
gradients on the host and copies each block's weights up as it gathers them: the host step then updates those
weights in place (no copy of its own, nothing copied back), each unit on the thread while the next forward runs,
and the forward's wait before each unit keeps FSDP from gathering weights the host has not finished.

The moments are AdamW's own state (``step``, ``exp_avg``, ``exp_avg_sq``, placed like the
parameter when it is a DTensor), so checkpoints are AdamW's: a run may resume with the flag on or
off, on any layout. Saving or loading a checkpoint waits for the step in flight
(``settle``). On a CPU-only run host and device are one memory: the flag saves nothing there and
runs the same steps without copy streams (what the CPU tests exercise).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Adam, AdamW, Optimizer
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flame.models.registry import decoder_layers
from flame.optim import groups
from flame.optim.host_worker import SettlesFirst
from flame.optim.pinned import HostArena, chunk_bytes_for

STATE = ("exp_avg", "exp_avg_sq")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part, on the host) as the state of ``param``: a DTensor placed like it when it is one.

    Built on the parameter's own spec, as FSDP2's CPU offload builds its host shards:
    ``DTensor.from_local`` would move the host tensor to the mesh's GPU.
    """
    if isinstance(param, DTensor):
        return DTensor(local, param._spec, requires_grad=False)
    return local


@dataclass(eq=False)
class Unit:
    """Parameters the next forward needs together, and where the forward first needs them: before
    ``module`` runs, or (``after``) once it has run."""

    module: nn.Module
    params: list[torch.Tensor]
    after: bool = False
    host_params: list[torch.Tensor] = field(default_factory=list)  # pinned fp32 copies of the weights (local parts)
    host_grads: list[torch.Tensor] = field(default_factory=list)  # pinned: where the gradients land (offloaded: them)
    copied: bool = False  # host_params hold the model's weights (copied at the first step and after a load)
    on_host: object = None  # CUDA event: the gradients have reached the host
    updated: object = None  # CUDA event: the new weights have reached the GPU
    ready: threading.Event = field(default_factory=threading.Event)  # the host thread is done with this unit
    pending: bool = False  # stepped, and the GPU's forward has not waited for it yet


def units_of(model: nn.Module) -> list[Unit]:
    """The model's trainable parameters in the order the next forward uses them.

    The input embeddings come first (waited for as the forward starts), then each decoder block,
    then the rest (final norm, output head: waited for once the last block has run, since a
    fused loss may read the head's weight without calling it). Under FSDP the root's weights are
    gathered as the forward starts, so everything outside the blocks comes first there.
    """
    blocks = decoder_layers(model)
    in_blocks = {id(p) for p in blocks.parameters()}
    outside = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None or isinstance(model, FSDPModule):
        start, rest = outside, []
    else:
        first = {id(p) for p in embeddings.parameters()}
        start, rest = [p for p in outside if id(p) in first], [p for p in outside if id(p) not in first]
    units = [Unit(model, start)] if start else []
    units += [Unit(block, params) for block in blocks if (params := [p for p in block.parameters() if p.requires_grad])]
    return units + ([Unit(blocks[-1], rest, after=True)] if rest else [])


def leading_units(units: list[Unit], model: nn.Module, blocks: int) -> int:
    """How many of ``units`` come before the forward has run the first ``blocks`` decoder blocks (0 for none)."""
    if blocks <= 0:
        return 0
    first = {id(block) for block in list(decoder_layers(model))[:blocks]}
    reached = [index for index, unit in enumerate(units) if id(unit.module) in first and not unit.after]
    return reached[-1] + 1 if reached else 0


def by_hyperparameters(params: list[torch.Tensor], live: list[int], settings: dict) -> dict[tuple, list[int]]:
    """The indices of ``live`` grouped by their parameter's group's (lr, beta1, beta2, eps, weight_decay), as of now
    (the LR schedule moves on before a host thread steps them)."""
    groups = defaultdict(list)
    for i in live:
        group = settings[id(params[i])]
        groups[(group["lr"], *group["betas"], group["eps"], group["weight_decay"])].append(i)
    return dict(groups)


def fused_adam(decoupled: bool, hyper: tuple, params: list, grads: list, states: list[dict],
               grad_scale: torch.Tensor | None = None) -> None:
    """torch's fused AdamW (``decoupled``) or Adam kernel over ``params`` where they are, with their ``states``;
    the gradients divided by ``grad_scale`` as it reads them."""
    lr, beta1, beta2, eps, weight_decay = hyper
    (adamw if decoupled else adam)(
        params, grads, [local_part(s["exp_avg"]) for s in states], [local_part(s["exp_avg_sq"]) for s in states],
        [], [s["step"] for s in states], fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=grad_scale)


class HostAdamW(Optimizer):
    """AdamW (``decoupled=True``) or Adam over a model's parameters, its state and update on the host.

    The parameter groups hold the model's own parameters (the LR schedule and checkpoints see an
    ordinary optimizer); the state is ``torch.optim.AdamW``'s, on the host, but for the units up to
    the ``gpu_blocks``-th decoder block, whose state stays on the parameters' device.
    """

    def __init__(self, model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 decoupled: bool = True, host_threads: int | None = None, gpu_blocks: int = 0,
                 param_groups: list[dict] | None = None):
        self.units = units_of(model)
        self.on_device = leading_units(self.units, model, gpu_blocks)  # the first units: state and step on the GPU
        params = [p for p in model.parameters() if p.requires_grad]  # the model's order, as torch's AdamW has them
        # torch's own defaults for these settings (amsgrad, fused, ...): the checkpoint's groups are then AdamW's
        like = (AdamW if decoupled else Adam)([torch.zeros(1, requires_grad=True)], lr=lr, betas=betas, eps=eps,
                                               weight_decay=weight_decay, fused=True)
        super().__init__(param_groups or params, like.defaults)  # the groups' own lr and weight decay (flame.optim.groups)
        self.decoupled = decoupled
        # FSDP's CPU offload keeps the weights and their gradients on the host already: step them where they are
        self.in_place = any(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params)
        self.cuda = not self.in_place and params[0].is_cuda
        # the host's copies of the weights and gradients stepped there, pinned without the allocator's rounding
        copied = 0 if self.in_place else sum(local_part(p).numel() for unit in self.units[self.on_device :]
                                             for p in unit.params)
        self.arena = HostArena(pin=self.cuda, chunk_bytes=chunk_bytes_for(2 * 4 * copied))
        if self.cuda:
            self.device = params[0].device
            self.to_host, self.to_device = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        # the host step's CPU threads: one core left to the thread that launches the GPU's work
        self.host_threads = host_threads or max(1, torch.get_num_threads() - 1)
        self.worker: threading.Thread | None = None
        self.error: BaseException | None = None
        self.waited = 0.0  # seconds the forward has waited for the host, all steps together
        self.stepping = 0.0  # seconds the host thread spent in AdamW, all steps together
        self.copying = 0.0  # seconds it waited for gradients to reach the host, all steps together
        self.hooks = [self._hook(unit, self.units[index + 1:index + 2]) for index, unit in enumerate(self.units)]

    def _hook(self, unit: Unit, following: list[Unit]):
        if unit.after:
            return unit.module.register_forward_hook(lambda module, args, output: self._wait(unit))
        # streamed, FSDP gathers the next block's offloaded weights while this one computes: both must be stepped
        waited = [unit, *following] if self.in_place else [unit]

        def wait(module, args) -> None:
            for each in waited:
                self._wait(each)

        return unit.module.register_forward_pre_hook(wait, prepend=True)  # ahead of FSDP's, which gathers the weights

    def _wait(self, unit: Unit) -> None:
        """Before a unit computes: its new weights are on the GPU (or the GPU's stream will wait for them)."""
        if not unit.pending:
            return
        if not unit.ready.is_set():
            start = time.perf_counter()
            unit.ready.wait()
            self.waited += time.perf_counter() - start
        if self.error is not None:
            cause = f"{type(self.error).__name__}: {(str(self.error).splitlines() or [''])[0]}"
            raise RuntimeError(f"--optimizer.on_host: the host's optimizer step failed ({cause})") from self.error
        if unit.updated is not None:
            if any(isinstance(p, DTensor) for p in unit.params):
                # FSDP gathers on its own streams, which wait for the GPU's stream only as the forward starts
                unit.updated.synchronize()
            else:
                torch.cuda.current_stream(self.device).wait_event(unit.updated)
        unit.pending = False

    def settle(self) -> None:
        """Every unit's update finished and visible to the GPU's stream: before a checkpoint reads or writes the
        weights or the state, and before the next step."""
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        for unit in self.units:
            self._wait(unit)

    def _host_copies(self, unit: Unit) -> None:
        """The unit's pinned buffers (taken once), the weights copied into them (first step, after a checkpoint loaded)."""
        locals_ = [local_part(p) for p in unit.params]
        if not unit.host_params:
            unit.host_params = [self.arena.take(t.shape) for t in locals_]
            unit.host_grads = [self.arena.take(t.shape) for t in locals_]
        for host, param in zip(unit.host_params, locals_):
            host.copy_(param.detach())
        unit.copied = True

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("--optimizer.on_host steps without a closure")
        self.settle()
        settings = {id(p): group for group in self.param_groups for p in group["params"]}
        if self.cuda:
            self.to_host.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are complete
        for unit in self.units[: self.on_device]:
            self._step_on_device(unit, settings)
        work = []
        for unit in self.units[self.on_device :]:
            if self.in_place:  # the gradients as of now: zero_grad drops the parameters' references before the thread runs
                live = self._live(unit, [local_part(p) for p in unit.params])
                unit.host_grads = [local_part(p.grad) if p.grad is not None else None for p in unit.params]
                unit.ready.clear()
                unit.pending = True
                work.append((unit, by_hyperparameters(unit.params, live, settings)))
                continue
            if not unit.copied:
                self._host_copies(unit)
            live = self._live(unit, unit.host_params)
            if self.cuda:
                with torch.cuda.stream(self.to_host):
                    for i in live:
                        grad = local_part(unit.params[i].grad)
                        unit.host_grads[i].copy_(grad, non_blocking=True)
                        grad.record_stream(self.to_host)  # zero_grad may drop it before the copy ran
                    unit.on_host = self.to_host.record_event()
            else:
                for i in live:
                    unit.host_grads[i].copy_(local_part(unit.params[i].grad))
            unit.ready.clear()
            unit.pending = True
            # the hyperparameters as of now: the LR schedule moves on before the thread runs
            work.append((unit, by_hyperparameters(unit.params, live, settings)))
        self.worker = threading.Thread(target=self._run, args=(work,), name="flame-host-optimizer", daemon=True)
        self.worker.start()

    def _live(self, unit: Unit, kept_like: list[torch.Tensor]) -> list[int]:
        """The indices of the unit's parameters that have a gradient, each with its state (new ones zero, in
        fp32 where ``kept_like``'s tensor is: the host copy, or the parameter's own device)."""
        live = [i for i, p in enumerate(unit.params) if p.grad is not None]
        for i in live:
            param = unit.params[i]
            if not self.state.get(param):
                local = torch.zeros_like(kept_like[i], dtype=torch.float32)
                self.state[param] = {"step": torch.zeros((), dtype=torch.float32, device=local.device),
                                     **{name: _like(param, local.clone()) for name in STATE}}
        return live

    def _step_on_device(self, unit: Unit, settings: dict) -> None:
        """A leading unit's step where its weights are, on the GPU's stream, before the host starts on the rest."""
        live = self._live(unit, [local_part(p) for p in unit.params])
        for hyper, indices in by_hyperparameters(unit.params, live, settings).items():
            fused_adam(self.decoupled, hyper, [local_part(unit.params[i]) for i in indices],
                       [local_part(unit.params[i].grad) for i in indices], [self.state[unit.params[i]] for i in indices])

    @torch.no_grad()  # grad mode is per thread
    def _run(self, work: list) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            torch.set_num_threads(self.host_threads)  # this thread's own (OpenMP's per-thread setting)
            for unit, groups in work:
                start = time.perf_counter()
                if unit.on_host is not None:
                    unit.on_host.synchronize()
                copied = time.perf_counter()
                for hyper, indices in groups.items():
                    self._update(unit, hyper, indices)
                self.copying += copied - start
                self.stepping += time.perf_counter() - copied
                indices = [i for group in groups.values() for i in group]
                if self.in_place:
                    # stepped: let go of this step's gradients, which zero_grad then frees before the next backward
                    # allocates its own (held, a 7B's offloaded gradients were on the host twice: 25 GiB more)
                    unit.host_grads = []
                elif self.cuda:
                    with torch.cuda.stream(self.to_device):
                        for i in indices:
                            local_part(unit.params[i]).copy_(unit.host_params[i], non_blocking=True)
                        unit.updated = self.to_device.record_event()
                else:
                    for i in indices:
                        local_part(unit.params[i]).copy_(unit.host_params[i])
                unit.ready.set()
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread, by the next forward or settle
            self.error = error
            for unit, _ in work:
                unit.ready.set()

    def _update(self, unit: Unit, hyper: tuple, indices: list[int]) -> None:
        # in place: the offloaded weights themselves, which FSDP copies up when it gathers them
        params = [local_part(unit.params[i]) for i in indices] if self.in_place else [unit.host_params[i] for i in indices]
        fused_adam(self.decoupled, hyper, params, [unit.host_grads[i] for i in indices], [self.state[unit.params[i]] for i in indices])

    def state_dict(self):
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """A checkpoint's AdamW state, kept on the host (``torch.optim.Optimizer`` would move it to the parameters'
        device: for a moment, all of it on the GPU), and the host's weight copies taken again from the model."""
        self.settle()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
                             f"{len(self.param_groups)}")
        by_id = {}
        for saved, group in zip(saved_groups, self.param_groups):
            by_id.update(zip(saved["params"], group["params"]))
            group.update({key: value for key, value in saved.items() if key != "params"})
        self.state = defaultdict(dict)
        on_device = {id(p) for unit in self.units[: self.on_device] for p in unit.params}
        for key, saved in state_dict["state"].items():
            param = by_id[key]
            where = local_part(param).device if id(param) in on_device else torch.device("cpu")
            self.state[param] = {name: self._placed(param, value, where) for name, value in saved.items()}
        for unit in self.units:
            unit.copied = False  # the model's weights were loaded too: copied again at the next step

    @staticmethod
    def _placed(param: torch.Tensor, value, where: torch.device):
        """A saved state tensor as this optimizer keeps it: fp32 on ``where`` (a copy: never the checkpoint's own)."""
        if not torch.is_tensor(value):
            return value
        local = local_part(value).detach().to(where, torch.float32, copy=True)
        return _like(param, local) if isinstance(value, DTensor) else local


class HostOptimizersContainer(SettlesFirst, OptimizersContainer):
    """torchtitan's container of one optimizer per model part, each a HostAdamW."""

    def __init__(self, model_parts: list[nn.Module], kwargs: dict, decoupled: bool, gpu_blocks: int = 0,
                 optimizer_config: Any = None) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        for model in model_parts:
            parts = groups.groups_of(model, optimizer_config) if optimizer_config is not None else []
            if parts:
                logger.info(f"Parameter groups ({optimizer_config.name}, on the host): "
                            f"{groups.describe(parts, kwargs['lr'], optimizer_config)}")
            self.optimizers.append(HostAdamW(model, **kwargs, decoupled=decoupled, gpu_blocks=gpu_blocks,
                                             param_groups=[g.torch_group(kwargs["lr"]) for g in parts]))
        self._validate_length(len(model_parts))
        self._post_init([p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]],
                        kwargs)

    def settle(self) -> None:
        for optimizer in self.optimizers:
            optimizer.settle()
