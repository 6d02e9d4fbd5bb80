"""Muon, flame's own optimizer: its classes and its record (flame.optim.record).

``--optimizer.name Muon`` trains the weight of every ``nn.Linear`` inside the decoder blocks
with Muon (momentum, then the update orthogonalized by a Newton-Schulz iteration in bf16), and
everything else with AdamW: embeddings, the output head (2-D too, but their rows are per-token
vectors, not a linear map between hidden states), norms, biases, convolutions and any other
parameter. Both groups live in one optimizer per model part, so torchtitan's LR schedule,
gradient clipping, DCP checkpoints (exact resume, resharding) and the trainer's
skip-on-spike logic treat a Muon run like an AdamW run.

Scale rule: with ``--optimizer.muon_adjust_lr match_rms_adamw`` (default) a matrix of shape
(A, B) takes the step ``lr * 0.2 * sqrt(max(A, B))`` times its orthogonalized update, whose
RMS is then about 0.2, the RMS of a typical AdamW update: the lr and weight decay tuned for
AdamW serve Muon too (``--optimizer.muon_lr`` defaults to ``--optimizer.lr``). ``original``
scales by ``sqrt(max(1, A / B))`` instead and wants a far larger lr (about 0.02). Both are
torch.optim.Muon's ``adjust_lr_fn`` rules.

Sharded weights (FSDP, HSDP, TP, and FSDP x TP: DTensors): Newton-Schulz must see the whole
matrix (orthogonalizing each shard alone is another update). Each step gathers every Muon
matrix's update in bf16 (one all-gather over the mesh per stack of same-shape, same-layout
matrices: as many bytes as FSDP's bf16 all-gather of those weights in a forward), orthogonalizes
the whole matrices on every rank, and keeps the rank's own shards; momentum stays sharded. So every rank
does the full Newton-Schulz FLOPs of one GPU, about ``5 * (4 m^2 n + 2 m^3)`` per m x n matrix
(m <= n): they do not shrink as ranks are added. Pipeline stages each hold their own matrices:
nothing is gathered across stages.
"""

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import (
    _StridedShard,  # FSDP x TP's layout (torch 2.11-2.13)
)
from torch.optim import AdamW, Optimizer
from torch.optim._muon import (
    _adjust_lr,  # torch.optim.Muon's own scale rules (the same in torch 2.11-2.13)
)
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flame.base.errors import check_number
from flame.models.registry import decoder_layers
from flame.optim import groups
from flame.optim.host import local_part
from flame.optim.record import OptimizerRecord, register

# Newton-Schulz runs on stacks of matrices of one shape and layout (one gather and one batched matmul
# per stack instead of per matrix: a 24-layer model has ~170 matrices but a few shapes); a stack holds
# at most this many elements, which bounds the step's extra memory (bf16, a few copies, two stacks).
STACK_ELEMENTS = 1 << 27


def newton_schulz(stack: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The approximate orthogonal factor (U V^T of U S V^T) of each matrix of a (batch, m, n) stack, in bf16.

    torch.optim.Muon's iteration, batched: each matrix scaled to Frobenius norm 1 (spectral norm
    <= 1), then ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the wide orientation.
    """
    a, b, c = coefficients
    x = stack.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:  # X X^T is then the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _layout(param: torch.Tensor) -> tuple:
    """What matrices must share to be gathered as one stack: shape, and mesh and placements if sharded."""
    if isinstance(param, DTensor):
        return tuple(param.shape), param.device_mesh, tuple(param.placements)
    return (tuple(param.shape),)


def _stacked(placement: Placement) -> Placement:
    """The placement of a stack of matrices (one dimension in front) whose matrices are each placed so."""
    if isinstance(placement, _StridedShard):  # FSDP over TP shards of the same dimension
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + 1)
    return placement


def _gather(updates: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The whole matrices of this rank's shards ``updates`` (each laid out like ``like``), stacked, in bf16.

    Sharded: one all-gather over the mesh for the stack; it returns before the data arrives (DTensor's
    collectives are asynchronous), so the next stack's gather overlaps this one's iteration.
    """
    stack = torch.stack([update.bfloat16() for update in updates])
    if not isinstance(like, DTensor):
        return stack
    sharded = DTensor.from_local(stack, like.device_mesh, [_stacked(p) for p in like.placements], run_check=False,
                                 shape=(len(updates), *like.shape), stride=(like.numel(), *like.stride()))
    return sharded.full_tensor()


def _own_shards(stack: torch.Tensor, like: torch.Tensor) -> list[torch.Tensor]:
    """This rank's part of each whole matrix of ``stack``, laid out like ``like`` (a local slice: no communication)."""
    if isinstance(like, DTensor):
        mesh = like.device_mesh
        replicated = DTensor.from_local(stack, mesh, [Replicate()] * mesh.ndim, run_check=False)
        stack = replicated.redistribute(mesh, [_stacked(p) for p in like.placements]).to_local()
    return list(stack.unbind(0))


def _closure_loss(closure) -> torch.Tensor | None:
    """An optimizer step's ``closure`` run with gradients on (torch.optim's contract), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its hyperparameters, checks, state and scale rules) with a step that
    orthogonalizes whole matrices when they are sharded DTensors, and stacks same-shape matrices.

    The update equals torch.optim.Muon's on unsharded weights (tests/optim/test_muon.py compares them).
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            if params:
                self._update(group, params, [local_part(g) for g in grads], [local_part(b) for b in buffers])
        return loss

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
                buffers: list[torch.Tensor]) -> None:
        momentum, lr = group["momentum"], group["lr"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        stacks = defaultdict(list)
        for i, param in enumerate(params):
            stacks[_layout(param)].append(i)
        chunks = [indices[start : start + size] for indices in stacks.values()
                  for size in [max(1, STACK_ELEMENTS // params[indices[0]].numel())]
                  for start in range(0, len(indices), size)]
        gathered = _gather([updates[i] for i in chunks[0]], params[chunks[0][0]])
        for k, chunk in enumerate(chunks):
            whole, like = gathered, params[chunk[0]]
            if k + 1 < len(chunks):  # the next stack's gather runs during this one's iteration
                gathered = _gather([updates[i] for i in chunks[k + 1]], params[chunks[k + 1][0]])
            ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            local = [local_part(params[i]) for i in chunk]
            torch._foreach_mul_(local, 1 - lr * group["weight_decay"])
            torch._foreach_add_(local, _own_shards(ortho, like), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], like.shape))


class MuonWithAdamW(Optimizer):
    """One optimizer over a model part: Muon for its hidden matrices, AdamW for the other parameters.

    Its param groups are the AdamW group(s), then the Muon group(s); one state dict and one LR
    schedule cover both (each group keeps its own base lr). The inner optimizers step on this
    optimizer's groups and state, also after a checkpoint replaced them (``load_state_dict``).
    """

    def __init__(self, muon: list[nn.Parameter], adamw: list[dict], muon_kwargs: dict, adamw_kwargs: dict):
        # AdamW's groups first: the trainer logs the first group's lr, which is then --optimizer.lr's schedule
        self._inner = ([AdamW(adamw, **adamw_kwargs)] if adamw else []) + ([Muon(muon, **muon_kwargs)] if muon else [])
        self._group_counts = [len(o.param_groups) for o in self._inner]
        super().__init__([group for o in self._inner for group in o.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        first = 0
        for optimizer, count in zip(self._inner, self._group_counts):
            optimizer.param_groups, optimizer.state = self.param_groups[first : first + count], self.state
            optimizer.step()
            first += count
        return loss


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's) of a model (part): the weights of the decoder blocks' nn.Linear
    layers, and every other trainable parameter."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    not_hidden = {id(p) for module in (head, model.get_input_embeddings() if hasattr(model, "get_input_embeddings")
                                       else None) if module is not None for p in module.parameters()}
    hidden = {id(m.weight): m.weight for m in decoder_layers(model).modules()
              if isinstance(m, nn.Linear) and m.weight.requires_grad and id(m.weight) not in not_hidden}
    others = {id(p): p for p in model.parameters() if p.requires_grad and id(p) not in hidden}
    return list(hidden.values()), list(others.values())


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's container of one optimizer per model part, each a MuonWithAdamW."""

    def __init__(self, model_parts: list[nn.Module], muon_kwargs: dict, adamw_kwargs: dict, optimizer_config: Any) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        for model in model_parts:
            muon, adamw = split_parameters(model)
            adamw_groups = groups.groups_of(model, optimizer_config, only={id(p) for p in adamw})
            self.optimizers.append(MuonWithAdamW(muon, [g.torch_group(adamw_kwargs["lr"]) for g in adamw_groups],
                                                 muon_kwargs, adamw_kwargs))
            all_params += muon + adamw
            logger.info(f"Muon on {len(muon)} hidden matrices ({sum(p.numel() for p in muon):,} parameters); AdamW's "
                        f"parameter groups: {groups.describe(adamw_groups, adamw_kwargs['lr'], optimizer_config)}")
        self._validate_length(len(model_parts))
        self._post_init(all_params, adamw_kwargs)


def build(model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: ParallelDims | None,
          ft_manager: FTManager | None = None) -> OptimizersContainer:
    """One MuonWithAdamW per model part: AdamW's settings from the shared fields, Muon's from the muon_ ones."""
    o = optimizer_config
    adamw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay,
             "fused": o.implementation == "fused", "foreach": o.implementation == "foreach"}
    muon = {"lr": o.lr if o.muon_lr is None else o.muon_lr, "momentum": o.muon_momentum,
            "weight_decay": o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay,
            "nesterov": o.muon_nesterov, "ns_steps": o.muon_ns_steps, "adjust_lr_fn": o.muon_adjust_lr}
    return MuonOptimizersContainer(model_parts, muon, adamw, o)


def check(optimizer_config: Any) -> None:
    """Muon's own settings in range (muon_adjust_lr is a Literal: the parser refuses other values)."""
    o = optimizer_config
    if o.muon_lr is not None:
        check_number("--optimizer.muon_lr", o.muon_lr, 0)
    check_number("--optimizer.muon_momentum", o.muon_momentum, 0, 1, high_open=True)
    if o.muon_weight_decay is not None:
        check_number("--optimizer.muon_weight_decay", o.muon_weight_decay, 0)
    check_number("--optimizer.muon_ns_steps", o.muon_ns_steps, 1, 99, meaning=" (Newton-Schulz iterations; 5 is usual)")


MUON = register(OptimizerRecord(
    name="Muon", summary="torch.optim.Muon's update on whole matrices for the hidden matrices, AdamW for the rest",
    takes="Muon: the weights of the decoder blocks' nn.Linear layers; AdamW: embeddings, output head, norms, biases "
          "and every other parameter (split_parameters)",
    build=build, state_bytes=8, matrix_state_bytes=4, state="one momentum for matrices, AdamW's two for the rest",
    steps_on_host=False, offloads=False, on_gpu_only="Muon gathers and orthogonalizes whole matrices on the GPU",
    owns=("optimizer.muon_lr", "optimizer.muon_adjust_lr", "optimizer.muon_momentum", "optimizer.muon_nesterov",
          "optimizer.muon_weight_decay", "optimizer.muon_ns_steps"),
    check=check))
