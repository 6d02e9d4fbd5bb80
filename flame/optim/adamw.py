"""AdamW and Adam: torchtitan's optimizers (torch.optim's, one per model part), flame's default.

Built from the optimizer section (lr, beta1, beta2, eps, weight_decay, implementation) over each model part's
parameter groups (flame.optim.groups: no decay on embeddings, norms and biases by default). Under
``--optimizer.on_host`` flame.optim.host steps the same update on the host.
"""

from typing import Any

import torch
from torch import nn
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flame.optim import groups
from flame.optim.record import OptimizerRecord, register


class GroupedOptimizersContainer(OptimizersContainer):
    """torchtitan's container of one optimizer per model part, each over the part's parameter groups
    (flame.optim.groups) instead of one group of every parameter."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict,
                 optimizer_config: Any) -> None:
        self.model_parts, self.optimizers, all_params = model_parts, [], []
        for model in model_parts:
            parts = groups.groups_of(model, optimizer_config)
            self.optimizers.append(optimizer_cls([g.torch_group(optimizer_kwargs["lr"]) for g in parts], **optimizer_kwargs))
            all_params += [p for g in parts for p in g.params]
            logger.info(f"Parameter groups ({optimizer_config.name}): {groups.describe(parts, optimizer_kwargs['lr'], optimizer_config)}")
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)


def build(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: ParallelDims | None,
          ft_manager: FTManager | None = None) -> OptimizersContainer:
    """torch.optim.AdamW or Adam (by ``optimizer_config.name``), one per model part, over its parameter groups."""
    o = optimizer_config
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay,
              "fused": o.implementation == "fused", "foreach": o.implementation == "foreach"}
    return GroupedOptimizersContainer(model_parts, {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name],
                                      kwargs, o)


def skips_on_gpu(optimizer_config: Any) -> bool:
    """torch's fused kernel reads the optimizer's ``found_inf`` and leaves weights, moments and step count as they
    were when it is set; foreach and for-loop Adam, and the host's step, do not."""
    return optimizer_config.implementation == "fused" and not optimizer_config.on_host


_TAKES = "every trainable parameter"
# AdamW first: the default, and the optimizer a refusal suggests (flame.optim.record.first_that)
ADAMW = register(OptimizerRecord(
    name="AdamW", summary="Adam with decoupled weight decay (torch.optim.AdamW): flame's default", takes=_TAKES,
    build=build, state_bytes=8, skips_on_gpu=skips_on_gpu))
ADAM = register(OptimizerRecord(
    name="Adam", summary="Adam with the weight decay added to the gradient (torch.optim.Adam)", takes=_TAKES,
    build=build, state_bytes=8, decoupled=False, skips_on_gpu=skips_on_gpu))
