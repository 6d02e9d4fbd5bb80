"""Mixture-of-experts models of transformers (qwen3_moe, olmoe, mixtral, qwen2_moe, ...): what flame adds to HF's own.

transformers keeps each MoE layer's experts as stacked 3-D weights and, where torch has grouped_mm, runs them as
one grouped GEMM (``config._experts_implementation`` "grouped_mm", its default; "eager" is its loop over experts).
flame keeps that, and in training:
- asks the model for its router logits (``output_router_logits``) and adds the model's load-balancing loss to the
  loss with its ``router_aux_loss_coef``: over each micro-batch of all data-parallel ranks together, weighted by its
  targets, so that a step's term does not depend on the number of ranks (``Routing.loss_term``; one batch on one rank:
  transformers' own loss);
- counts the tokens each layer routes to each expert (``RouterLoad``), for the log: per layer the most and the least
  loaded expert as a multiple of an even share, and the entropy of the load (1 = even);
- counts FLOPs on the active parameters: top_k / num_experts of every expert weight, and the routers
  (``active_matmul_weights``, read by flame.models.flops).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100  # transformers' and torchtitan's


def routes(config) -> bool:
    """Whether ``config`` is of a transformers MoE type whose routers the model can return (and score)."""
    return hasattr(config, "output_router_logits") and hasattr(config, "router_aux_loss_coef")


def expert_count(config) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"{config.model_type}: no expert count (num_experts, num_local_experts or n_routed_experts)")


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights (one 3-D tensor per projection, experts first) of ``model``'s MoE layers."""
    return [param for module in model.modules() for name, param in module.named_parameters(recurse=False)
            if param.ndim == 3 and name in ("gate_up_proj", "down_proj", "gate_proj", "up_proj")]


def router_weights(model: nn.Module) -> list[nn.Parameter]:
    """The routers' weights (experts x hidden), which transformers keeps outside nn.Linear."""
    return [module.weight for module in model.modules()
            if type(module).__name__.lower().endswith("router") and getattr(module, "weight", None) is not None]


def active_matmul_weights(model: nn.Module) -> float:
    """The matmul weights of MoE layers a token's forward multiplies: top_k / num_experts of each expert weight, and
    the routers' (0 for a dense model); nn.Linear layers (attention, shared experts) are counted as dense."""
    config = model.config
    if not routes(config):
        return 0.0
    experts = sum(w.numel() for w in expert_weights(model)) * config.num_experts_per_tok / expert_count(config)
    return experts + sum(w.numel() for w in router_weights(model))


@dataclass(frozen=True)
class Routing:
    """A MoE model's router terms: the load-balancing loss's coefficient, top_k, the expert count, and the ranks whose
    micro-batches are balanced together (the data-parallel and context-parallel ones; None: this process alone)."""

    coefficient: float
    top_k: int
    experts: int
    group: Any = None

    @classmethod
    def of(cls, config, group=None) -> "Routing | None":
        if not routes(config):
            return None
        return cls(float(config.router_aux_loss_coef or 0.0), int(config.num_experts_per_tok), expert_count(config),
                   group)

    def loss_term(self, output, labels: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of the load-balancing loss of the micro-batch, as a sum over targets like the loss (None for
        an output without router logits: validation, a model part without MoE layers).

        The model's loss (transformers' ``load_balancing_loss_func``): experts x sum over experts of f x P, f the
        fraction of the top_k choices that go to the expert and P its mean router probability, both over every MoE
        layer and token. flame counts f and P over this micro-batch of every data-parallel rank together (one
        all-reduce of a few numbers per layer), so that the term does not depend on how the micro-batch is split
        over ranks; each rank's part carries the gradient of its own tokens' P, and the parts add up to the
        coefficient x the loss x the micro-batch's targets over the ranks. One batch on one rank: transformers' own.
        """
        logits = getattr(output, "router_logits", None)
        if not logits or not torch.is_grad_enabled():
            return None
        probabilities = [torch.softmax(layer.float(), dim=-1) for layer in logits]
        with torch.no_grad():
            chosen = torch.stack([p.topk(self.top_k, dim=-1).indices.flatten() for p in probabilities])
            counts = torch.zeros(len(logits), self.experts, dtype=torch.float32, device=chosen.device)
            counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float32))
            rows = torch.full((1,), float(sum(p.shape[0] for p in probabilities)), device=counts.device)
            targets = (labels != IGNORE_INDEX).sum().float().reshape(1)  # on the device: no sync
            # over the ranks: the choices per expert, the rows (layers x tokens), the targets
            totals = torch.cat([counts.sum(dim=0), rows, targets.to(counts.device)])
            if self.group is not None:
                torch.distributed.all_reduce(totals, group=self.group)
            choices, rows, targets = totals[:-2], totals[-2], totals[-1]
        probability_sums = torch.stack([p.sum(dim=0) for p in probabilities]).sum(dim=0)
        part = self.experts * ((choices / rows) * (probability_sums / rows)).sum() * targets
        _window.add(counts, part.detach())
        return self.coefficient * part


class RouterLoad:
    """The routers' load since the last ``take``: tokens per (MoE layer, expert) and the aux loss summed over targets,
    on the device (no sync a step)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None

    def add(self, counts: torch.Tensor, aux_sum: torch.Tensor) -> None:
        """This rank's (layers, experts) choices and its part of the load-balancing loss summed over targets."""
        self.counts = counts if self.counts is None else self.counts + counts
        self.aux_sum = aux_sum if self.aux_sum is None else self.aux_sum + aux_sum

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(counts, aux sum) since the last call, and start again."""
        taken = self.counts, self.aux_sum
        self.counts = self.aux_sum = None
        return taken


_window = RouterLoad()  # this process's: the loss adds to it, the trainer's log takes it


def take_router_load() -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return _window.take()


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The log's expert-load metrics from (layers, experts) token counts: per layer ``moe/layer<i>/load_max``,
    ``load_min`` (the most and least loaded expert as a multiple of an even share) and ``load_entropy`` (of the load
    over the experts, normalized: 1 = even); and ``moe/load_max``, ``moe/load_min``, ``moe/load_entropy`` over the
    layers (the largest, the smallest, the mean)."""
    experts = counts.shape[1]
    share = counts / counts.sum(dim=1, keepdim=True).clamp_min(1)
    entropy = -(share * share.clamp_min(1e-12).log()).sum(dim=1) / torch.log(torch.tensor(float(experts)))
    most, least = (share.max(dim=1).values * experts).tolist(), (share.min(dim=1).values * experts).tolist()
    entropy = entropy.tolist()
    metrics = {"moe/load_max": max(most), "moe/load_min": min(least), "moe/load_entropy": sum(entropy) / len(entropy)}
    for layer, (high, low, even) in enumerate(zip(most, least, entropy)):
        metrics |= {f"moe/layer{layer}/load_max": high, f"moe/layer{layer}/load_min": low,
                    f"moe/layer{layer}/load_entropy": even}
    return metrics
