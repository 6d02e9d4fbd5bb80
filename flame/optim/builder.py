"""torchtitan's TrainSpec hooks for the optimizer: ``build_optimizers`` (through the optimizer's record,
flame.optim.record, or on the host for ``--optimizer.on_host``) and ``build_lr_schedulers``; and what a
resume needs of them: the configured settings put back after a checkpoint loads (``ConfiguredSettings``),
and a run's schedule as a function (``schedule``)."""

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtitan.components import lr_scheduler as torchtitan_lr_scheduler
from torchtitan.components.ft import FTManager
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger as torchtitan_logger

from flame.base import device
from flame.distributed.parallelize import STREAMED_IN
from flame.optim.host import HostOptimizersContainer
from flame.optim.streamed_adamw import StreamedOptimizersContainer
from flame.optim.muon import MuonOptimizersContainer
from flame.optim.record import optimizer_record

# what a param group holds beside its settings: the parameters, and the lrs the schedule sets
_NOT_SETTINGS = ("params", "lr", "initial_lr")


def build_optimizers(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: ParallelDims | None,
                     ft_manager: FTManager | None = None) -> OptimizersContainer:
    """torchtitan TrainSpec ``build_optimizers_fn``: the record's optimizer, or for ``--optimizer.on_host`` its
    update stepped on the host (flame.optim.host; flame.prepare refuses it for a record that cannot), or for
    --memory.stream_weights the streamed model's (flame.optim.streaming)."""
    o = optimizer_config
    record = optimizer_record(o.name)
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    if (dtypes := getattr(model_parts[0], STREAMED_IN, None)) is not None:  # --memory.stream_weights
        where = torch.device(device.TYPE, torch.cuda.current_device()) if device.CUDA else torch.device("cpu")
        mesh = parallel_dims.get_mesh("fsdp") if parallel_dims is not None and parallel_dims.fsdp_enabled else None
        return StreamedOptimizersContainer(model_parts, kwargs, decoupled=record.decoupled, dtypes=dtypes, device=where,
                                           optimizer_config=o, mesh=mesh)
    if o.on_host:
        return HostOptimizersContainer(model_parts, kwargs, decoupled=record.decoupled, gpu_blocks=o.gpu_blocks,
                                       optimizer_config=o)
    return record.build(model_parts, o, parallel_dims, ft_manager)


class OwnBaseLRSchedulers(LRSchedulersContainer):
    """torchtitan's schedulers, each keeping its own optimizer's base lrs when a checkpoint loads.

    torchtitan saves the first scheduler's state and loads it into all of them, base lrs
    included: right while every optimizer has the same groups at the same lr. A Muon model part
    has two lrs, and a pipeline stage's groups may differ from the first stage's; the step count
    is what the schedulers share.
    """

    def __init__(self, built: LRSchedulersContainer):
        self.schedulers = built.schedulers

    def load_state_dict(self, state_dict: dict) -> None:
        for scheduler in self.schedulers:
            base_lrs, state = scheduler.base_lrs, copy.deepcopy(state_dict)
            state["lr_lambdas"] = state["lr_lambdas"][: len(base_lrs)]  # one per group, all the same schedule
            scheduler.load_state_dict(state)
            scheduler.base_lrs = base_lrs
            if len(scheduler._last_lr) != len(base_lrs):  # the lrs it would have set at the loaded step
                scheduler._last_lr = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, base_lrs)]


def build_lr_schedulers(optimizers: OptimizersContainer, lr_scheduler_config, training_steps: int) -> LRSchedulersContainer:
    """torchtitan TrainSpec ``build_lr_schedulers_fn``: torchtitan's schedule, per-optimizer base lrs for Muon."""
    built = torchtitan_lr_scheduler.build_lr_schedulers(optimizers, lr_scheduler_config, training_steps)
    return OwnBaseLRSchedulers(built) if isinstance(optimizers, MuonOptimizersContainer) else built



def schedule(lr_scheduler_config, training_steps: int) -> Callable[[int], float]:
    """The factor of the lr after ``n`` scheduler steps (the lr of step ``n + 1``), as build_lr_schedulers' schedule
    for ``training_steps`` gives it: for comparing the schedules of two runs without building their optimizers."""
    probe = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    was = torchtitan_logger.disabled  # its warnings (warmup longer than the run) are the ranks' to log
    torchtitan_logger.disabled = True
    try:
        return torchtitan_lr_scheduler.build_lr_schedulers([probe], lr_scheduler_config, training_steps).schedulers[0].lr_lambdas[0]
    finally:
        torchtitan_logger.disabled = was


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.tolist() == b.tolist()
    return a == b


def set_lr(group: dict, lr: float) -> None:
    if torch.is_tensor(group["lr"]):  # a tensor lr (capturable optimizers) keeps its tensor
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


class ConfiguredSettings:
    """The optimizers' hyper-parameters and base lrs as this run's config built them, to put back after a checkpoint
    loads: torch's ``load_state_dict`` takes the saved run's (every param group setting; the schedulers' base lrs),
    so without this a new --optimizer.lr or weight decay would be ignored. For a resume with the saved run's settings
    it changes nothing, bit for bit: the lr it sets is the one the scheduler's own step computes.
    """

    def __init__(self, lr_schedulers: LRSchedulersContainer):
        self.built = [
            (list(scheduler.base_lrs),
             [{key: copy.deepcopy(value) for key, value in group.items() if key not in _NOT_SETTINGS}
              for group in scheduler.optimizer.param_groups])
            for scheduler in lr_schedulers.schedulers
        ]

    def restore(self, lr_schedulers: LRSchedulersContainer) -> list[str]:
        """Put the configured settings back after a load; what differed from the checkpoint's (e.g. 'lr 0.001 -> 0.0005'),
        the lr of the next step included."""
        changed: dict[str, str] = {}
        for scheduler, (base_lrs, groups) in zip(lr_schedulers.schedulers, self.built):
            optimizer = scheduler.optimizer  # whose param groups a load has replaced
            for group, built in zip(optimizer.param_groups, groups):
                for key, value in built.items():
                    if not _same(group.get(key), value):
                        changed.setdefault(key, f"{key} {group.get(key)} -> {value}")
                        group[key] = copy.deepcopy(value)
            for saved, base in zip(scheduler.base_lrs, base_lrs):
                if saved != base:
                    changed.setdefault("base lr", f"lr {saved:g} -> {base:g}")
            scheduler.base_lrs = list(base_lrs)
            lrs = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, base_lrs)]
            for group, base, lr in zip(optimizer.param_groups, base_lrs, lrs):
                group["initial_lr"] = base
                set_lr(group, lr)
            if [float(lr) for lr in scheduler.get_last_lr()] != lrs:
                changed.setdefault("next lr", f"lr of step {scheduler.last_epoch + 1} {scheduler.get_last_lr()[0]:g} -> {lrs[0]:g}")
            scheduler._last_lr = lrs  # what the trainer logs as the step's lr
        return list(changed.values())
