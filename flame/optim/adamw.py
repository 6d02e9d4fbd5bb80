"""AdamW and Adam: torchtitan's optimizers (torch.optim's, one per model part), flame's default.

torchtitan builds them from the optimizer section (lr, beta1, beta2, eps, weight_decay,
implementation). Under ``--optimizer.on_host`` flame.optim.host steps the same update on the host.
"""

from typing import Any

from torch import nn
from torchtitan.components import optimizer as torchtitan_optimizer
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims

from flame.optim.record import OptimizerRecord, register


def build(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: ParallelDims | None,
          ft_manager: FTManager | None = None) -> OptimizersContainer:
    """torchtitan's container of torch.optim.AdamW or Adam (by ``optimizer_config.name``), one per model part."""
    return torchtitan_optimizer.build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)


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
