"""Mixture-of-experts models of transformers (qwen3_moe, olmoe, mixtral, qwen2_moe, ...): what flame adds to HF's own.

transformers keeps each MoE layer's experts as stacked 3-D weights; flame runs them on its own grouped GEMM
(flame.models.experts, also under expert parallelism), and in training:
- records each router's logits and choices (``RouterTap``) and adds the model's load-balancing loss to the loss with
  its ``router_aux_loss_coef``: over each micro-batch of all data-parallel ranks together, weighted by its targets, so
  that a step's term does not depend on the number of ranks (``Routing.loss_term``; one batch on one rank:
  transformers' own loss);
- counts the tokens each layer routes to each expert (``RouterLoad``, also for types without that loss), for the log
  (per layer the most and the least loaded expert as a multiple of an even share, and the entropy of the load, 1 =
  even) and for the routers' selection bias where the type has one (flame.training.expert_balance);
- counts FLOPs on the active parameters: top_k / num_experts of every expert weight, and the routers
  (``active_matmul_weights``, read by flame.models.flops).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flame.base.errors import ConfigError
from flame.models.experts import experts_modules

IGNORE_INDEX = -100  # transformers' and torchtitan's


def is_moe(config) -> bool:
    """Whether ``config`` is of a transformers mixture-of-experts type (experts, and a number of them per token)."""
    return bool(getattr(config, "num_experts_per_tok", None)) and _expert_count(config) is not None


def _expert_count(config) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def expert_count(config) -> int:
    count = _expert_count(config)
    if count is None:
        raise ValueError(f"{config.model_type}: no expert count (num_experts, num_local_experts or n_routed_experts)")
    return count


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights (one 3-D tensor per projection, experts first) of ``model``'s MoE layers."""
    return [param for module in experts_modules(model) for param in module.parameters(recurse=False) if param.ndim == 3]


def routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model``'s MoE layers, in layer order: transformers' ``*Router`` modules, whose forward returns
    (router logits, routing weights, expert ids)."""
    return [module for module in model.modules()
            if type(module).__name__.lower().endswith("router") and getattr(module, "weight", None) is not None]


def active_matmul_weights(model: nn.Module) -> float:
    """The matmul weights of MoE layers a token's forward multiplies: top_k / num_experts of each expert weight, and
    the routers' (0 for a dense model); nn.Linear layers (attention, shared experts) are counted as dense."""
    config = model.config
    if not is_moe(config):
        return 0.0
    experts = sum(w.numel() for w in expert_weights(model)) * config.num_experts_per_tok / expert_count(config)
    return experts + sum(router.weight.numel() for router in routers(model))


def active_params(model: nn.Module) -> int:
    """The parameters a token's forward multiplies: all but the experts it is not routed to."""
    experts = sum(w.numel() for w in expert_weights(model))
    return round(sum(p.numel() for p in model.parameters()) - experts * (1 - model.config.num_experts_per_tok /
                                                                          expert_count(model.config)))


class RouterTap:
    """What each router chose in the model's last training forward: (router logits, expert ids) per MoE layer.

    transformers returns router logits only with ``output_router_logits``, and then computes its own load-balancing
    loss in every forward, a second time beside flame's; types without a loss (DeepSeek-V3's bias-balanced routers)
    return none. So flame listens to the routers: a hook on each records its output while the model's forward runs
    in training (a root hook opens and closes the record), not while activation checkpointing recomputes a block in
    the backward.
    """

    def __init__(self) -> None:
        self.recording = False
        self.choices: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attach(self, model: nn.Module) -> int:
        """Listen to ``model``'s routers; how many there are."""
        found = routers(model)
        if found:
            model.register_forward_pre_hook(self._open)
            model.register_forward_hook(self._close)
            for router in found:
                router.register_forward_hook(self._record)
        return len(found)

    def _open(self, model: nn.Module, args) -> None:
        self.recording, self.choices = model.training and torch.is_grad_enabled(), []

    def _close(self, model: nn.Module, args, output) -> None:
        self.recording = False

    def _record(self, router: nn.Module, args, output) -> None:
        if self.recording:
            logits, _, indices = output
            self.choices.append((logits, indices))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The last training forward's (logits, expert ids) per MoE layer, once."""
        taken, self.choices = self.choices, []
        return taken


tap = RouterTap()  # this process's: flame.models.builder attaches it, the loss takes from it


@dataclass(frozen=True)
class Routing:
    """A MoE model's router terms: the load-balancing loss's coefficient (0: the model has none), top_k, the expert
    count, and the ranks whose micro-batches are balanced together (the data-parallel and context-parallel ones;
    None: this process alone)."""

    coefficient: float
    top_k: int
    experts: int
    group: Any = None

    @classmethod
    def of(cls, config, group=None) -> "Routing | None":
        if not is_moe(config):
            return None
        return cls(float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), int(config.num_experts_per_tok),
                   expert_count(config), group)

    def loss_term(self, labels: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of the load-balancing loss of the micro-batch the model just ran, as a sum over targets
        like the loss (None outside training: validation, a model part without MoE layers); its routers' load goes to
        the window the log reads either way.

        The model's loss (transformers' ``load_balancing_loss_func``): experts x sum over experts of f x P, f the
        fraction of the top_k choices that go to the expert and P its mean router probability, both over every MoE
        layer and token. flame counts f and P over this micro-batch of every data-parallel rank together (one
        all-reduce of a few numbers per layer), so that the term does not depend on how the micro-batch is split
        over ranks; each rank's part carries the gradient of its own tokens' P, and the parts add up to the
        coefficient x the loss x the micro-batch's targets over the ranks. One batch on one rank: transformers' own.
        """
        choices = tap.take()
        if not choices or not torch.is_grad_enabled():
            return None
        with torch.no_grad():
            counts = torch.stack([torch.bincount(indices.flatten(), minlength=self.experts) for _, indices in choices])
            counts = counts.float()
        if not self.coefficient:
            _window.add(counts, None)
            return None
        probabilities = [torch.softmax(logits.float(), dim=-1) for logits, _ in choices]
        with torch.no_grad():
            rows = torch.full((1,), float(sum(p.shape[0] for p in probabilities)), device=counts.device)
            targets = (labels != IGNORE_INDEX).sum().float().reshape(1)  # on the device: no sync
            # over the ranks: the choices per expert, the rows (layers x tokens), the targets
            totals = torch.cat([counts.sum(dim=0), rows, targets.to(counts.device)])
            if self.group is not None:
                torch.distributed.all_reduce(totals, group=self.group)
            per_expert, rows, targets = totals[:-2], totals[-2], totals[-1]
        probability_sums = torch.stack([p.sum(dim=0) for p in probabilities]).sum(dim=0)
        part = self.experts * ((per_expert / rows) * (probability_sums / rows)).sum() * targets
        _window.add(counts, part.detach())
        return self.coefficient * part


class RouterLoad:
    """The routers' load since the last ``take``: tokens per (MoE layer, expert) and the aux loss summed over targets
    (None for a model without one), on the device (no sync a step)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None

    def add(self, counts: torch.Tensor, aux_sum: torch.Tensor | None) -> None:
        """This rank's (layers, experts) choices and its part of the load-balancing loss summed over targets."""
        self.counts = counts if self.counts is None else self.counts + counts
        if aux_sum is not None:
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


SELECTION_BIAS = "e_score_correction_bias"  # transformers' name, on the routers of DeepSeek-V3-style types


def check_selection_bias(model: nn.Module, rate: float) -> None:
    """Refuse --training.router_bias_rate for a model whose routers carry no selection bias (before training)."""
    if not rate:
        return
    config = model.config
    if rate < 0:
        raise ConfigError(f"--training.router_bias_rate {rate:g} must be >= 0 (DeepSeek-V3 used 1e-3; 0 = off)")
    found = routers(model)
    if not found or not all(hasattr(router, SELECTION_BIAS) for router in found):
        what = "is not a mixture of experts" if not found else f"routes without a selection bias ({SELECTION_BIAS})"
        raise ConfigError(
            f"--training.router_bias_rate {rate:g}: {config.model_type} {what}, so its HF export could not route as "
            "flame trained it; types whose routers carry one: deepseek_v3, glm4_moe, dots1, ernie4_5_moe, minimax_m2 "
            "and others; balance this one with its load-balancing loss (router_aux_loss_coef in its config)"
        )


class SelectionBias:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after every step each expert's selection bias moves by
    ``rate`` toward an even load: up where the expert got fewer than the mean of its layer's tokens, down where it got
    more, over the tokens of every data-parallel rank (``group``). The bias only decides which experts a token goes
    to (the routers add it to the scores they rank, not to the routing weights), and it is the model's own buffer, so
    the checkpoint and the HF export keep it: transformers routes the export as flame trained it."""

    def __init__(self, model: nn.Module, rate: float, group=None) -> None:
        self.biases = [getattr(router, SELECTION_BIAS) for router in routers(model)]
        self.rate, self.group = rate, group

    @torch.no_grad()
    def update(self, counts: torch.Tensor) -> None:
        """Move the biases by this step's (MoE layers, experts) choices on this rank."""
        counts = counts.clone()
        if self.group is not None:
            torch.distributed.all_reduce(counts, group=self.group)
        steps = self.rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        for bias, step in zip(self.biases, steps):
            bias.add_(step.to(bias.dtype))
