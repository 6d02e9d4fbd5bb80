"""Expert parallelism (--parallelism.expert_parallel_degree): each MoE layer's experts split over groups of ranks.

The ranks of an expert-parallel group (torchtitan's "ep" mesh, taken from the data-parallel shard ranks) each hold
``experts / ep`` of every MoE layer's experts, as DTensors sharded on the expert dimension; flame's experts forward
(flame.models.experts) sends each token-expert pair to the rank holding its expert and the result back. Everything
else is as without it: every rank reads its own data, the other weights are sharded by FSDP over all data-parallel
ranks, and the experts by FSDP over the ranks that hold the same experts (torchtitan's "efsdp" mesh). The checkpoint
holds each expert weight whole (a DTensor's global shape), so a run resumes under any expert-parallel degree.
"""

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torchtitan.tools.logging import logger

from flame.base.errors import ConfigError
from flame.models import moe
from flame.models.experts import GROUP, experts_modules


def check_expert_parallel(config, job_config) -> None:
    """Refuse an expert-parallel layout this model cannot take, before any process group exists."""
    parallelism = job_config.parallelism
    ep = parallelism.expert_parallel_degree
    if ep <= 1:
        return
    if not moe.is_moe(config):
        raise ConfigError(f"--parallelism.expert_parallel_degree {ep}: {config.model_type} has no experts (not a "
                          "mixture of experts); leave it at 1")
    experts = moe.expert_count(config)
    if experts % ep:
        raise ConfigError(f"--parallelism.expert_parallel_degree {ep}: {config.model_type}'s {experts} experts do not "
                          f"split evenly over {ep} ranks; give a divisor of {experts}")
    for name in ("tensor_parallel_degree", "context_parallel_degree"):
        if getattr(parallelism, name) > 1:
            raise ConfigError(f"--parallelism.expert_parallel_degree {ep} with --parallelism.{name} "
                              f"{getattr(parallelism, name)}: flame runs expert parallelism over data-parallel ranks "
                              f"only; leave {name} at 1")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Shard each MoE layer's expert weights (and biases) over ``ep_mesh`` on the expert dimension, and give their
    modules the group their forward exchanges tokens in."""
    layers = experts_modules(model)
    for module in layers:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] == module.num_experts:  # stacked per expert: weights (experts, out, in), biases
                # every rank built the same (meta or seeded) weights: each takes its part, no communication
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        setattr(module, GROUP, ep_mesh.get_group())
    logger.info(f"Applied expert parallelism over {ep_mesh.size()} ranks to {len(layers)} MoE layers "
                f"({layers[0].num_experts // ep_mesh.size()} of {layers[0].num_experts} experts a rank)")


def expert_shard_placement(param: nn.Parameter, ranks: int) -> Shard:
    """FSDP's split of an expert weight over the ranks holding the same experts: by expert when they divide evenly,
    else by the weight's next dimension (fewer experts held than ranks)."""
    held = param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]
    return Shard(0) if held % ranks == 0 else Shard(1)
