"""torchtitan's TrainSpec hooks for the optimizer: ``build_optimizers`` (through the optimizer's record,
flame.optim.record, or on the host for ``--optimizer.on_host``) and ``build_lr_schedulers``."""

import copy
from typing import Any

from torch import nn
from torchtitan.components import lr_scheduler as torchtitan_lr_scheduler
from torchtitan.components.ft import FTManager
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims

from flame.optim.host import HostOptimizersContainer
from flame.optim.muon import MuonOptimizersContainer
from flame.optim.record import optimizer_record


def build_optimizers(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: ParallelDims | None,
                     ft_manager: FTManager | None = None) -> OptimizersContainer:
    """torchtitan TrainSpec ``build_optimizers_fn``: the record's optimizer, or for ``--optimizer.on_host`` its
    update stepped on the host (flame.optim.host; flame.prepare refuses it for a record that cannot)."""
    o = optimizer_config
    record = optimizer_record(o.name)
    if o.on_host:
        kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
        return HostOptimizersContainer(model_parts, kwargs, decoupled=record.decoupled, gpu_blocks=o.gpu_blocks)
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

