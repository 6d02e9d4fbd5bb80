"""flame's forward for the experts of transformers' MoE layers: one grouped GEMM per projection, on this rank's
experts or, under expert parallelism, on the experts this rank holds for the tokens of its whole expert group.

transformers keeps a MoE layer's experts as stacked weights (experts first) in a module whose forward takes the
tokens, each token's top-k expert ids and their routing weights, and dispatches on ``config._experts_implementation``
(its registry, ``ExpertsInterface``). flame registers its own there as "flame" and builds MoE models with it:
- the token-expert pairs are sorted by expert, each projection is one ``grouped_mm`` over them (on CPU a matmul an
  expert), and each token sums its pairs' results; the routing weight scales the down projection's input, the
  gathers' gradients are gathers too (no atomic adds), and no mask costs a pass (transformers' version masks the
  placeholders of tokens routed to other ranks): less memory kept for the backward, fewer passes over it;
- under autocast the weights are cast to the autocast dtype, as autocast does for an nn.Linear (torch's grouped_mm is
  not autocast; transformers would fall back to float32);
- under expert parallelism (flame.distributed.expert_parallel) each rank holds ``experts / ep`` of them: a rank sends
  each token-expert pair to the rank holding the expert (one all-to-all of the counts, whose sizes the host reads,
  then one of the rows), runs its experts on what it received, and sends the results back the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

IMPLEMENTATION = "flame"
GROUP = "flame_expert_group"  # the attribute flame.distributed.expert_parallel sets on a module of sharded experts


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that hold a MoE layer's stacked expert weights (transformers' ``*Experts``)."""
    return [module for module in model.modules()
            if hasattr(module, "num_experts") and any(param.ndim == 3 for param in module.parameters(recurse=False))]


def use_flame_experts(model: nn.Module) -> int:
    """Run ``model``'s MoE layers on flame's experts forward where they would run transformers' grouped GEMM (its
    default); the number of MoE layers switched. Another implementation named in the model config (``eager``, its
    loop over the experts) is kept, and so is a module that does not dispatch on one (not transformers' layout)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modules = [module for module in experts_modules(model)
               if hasattr(module, "has_gate") and getattr(module.config, "_experts_implementation", None) == "grouped_mm"]
    if modules:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, forward)
        for config in {id(module.config): module.config for module in modules}.values():
            config._experts_implementation = IMPLEMENTATION
    return len(modules)


def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: tokens (T, H), expert ids (T, k), routing weights (T, k) -> (T, H)."""
    top_k = top_k_index.shape[1]
    kind = hidden_states.device.type
    # the residual stream may be float32 under autocast: the experts take the autocast dtype, so gather that
    compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden_states.dtype
    choices = top_k_index.reshape(-1)
    order = torch.argsort(choices, stable=True)  # the token-expert pairs grouped by expert
    back = _inverse(order)
    sorted_choices = choices[order]
    # each expert's end in the sorted pairs: found in them, where torch.bincount's output size would depend on the
    # data (the host waits for it, and torch.compile splits the block's graph there)
    ends = torch.searchsorted(sorted_choices, torch.arange(1, self.num_experts + 1, device=choices.device))
    tokens = hidden_states.to(compute)
    weights = top_k_weights.reshape(-1)[order].to(compute)
    group = getattr(self, GROUP, None)
    if group is None:  # the first projection gathers its rows itself, and again in the backward rather than keep them
        out = _experts_mlp(self, lambda weight, offsets: _GatheredProduct.apply(tokens, order, back, top_k, weight, offsets),
                           weights, ends.to(torch.int32), sorted_choices)
    else:
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        out = _exchanged(self, _TokensOfPairs.apply(tokens, order, back, top_k), weights, counts, group)
    return _PairsToTokens.apply(out, order, back, top_k).to(hidden_states.dtype)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation, by one scatter (not a second sort)."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


class _Reorder(torch.autograd.Function):
    """``rows[index]`` for a permutation ``index`` whose inverse is ``inverse``: the gradient is gathered back by the
    inverse (torch's indexing scatters it with atomic adds, slow and unordered in bf16 on GPUs)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _spread(tokens: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """The token of each token-expert pair, the pairs in ``order``: ``tokens[order // k]``."""
    return tokens.index_select(0, order // top_k)


def _summed(pairs: torch.Tensor, back: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's sum over its k pairs (``pairs`` in the order whose inverse is ``back``): gathered and summed in
    order, no atomic adds."""
    return pairs.index_select(0, back).view(-1, top_k, pairs.shape[-1]).sum(dim=1)


class _TokensOfPairs(torch.autograd.Function):
    """``_spread``, whose gradient is ``_summed``: a token's gradient is the sum of its k pairs'."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, order: torch.Tensor, back: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.top_k = top_k
        return _spread(tokens, order, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _summed(grad, back, ctx.top_k), None, None, None


class _PairsToTokens(torch.autograd.Function):
    """``_summed``, whose gradient is ``_spread``: a pair's gradient is its token's. Nothing is kept for the backward
    but the indices (weighting the pairs before the sum would keep every pair's result for the routing weights'
    gradient: the weights are applied inside, ``_experts_mlp``)."""

    @staticmethod
    def forward(ctx, pairs: torch.Tensor, order: torch.Tensor, back: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _summed(pairs, back, top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _spread(grad, order, ctx.top_k), None, None, None


def _exchanged(self: nn.Module, rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
               group) -> torch.Tensor:
    """The experts' results for ``rows`` (grouped by expert, ``counts`` per expert over all experts; ``weights``
    their routing weights), computed by the ranks of ``group`` that hold them."""
    from torch.distributed import all_to_all_single
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ranks = group.size()
    held = self.num_experts // ranks
    received = torch.empty_like(counts)  # (source rank, my expert): the rows each rank sends each of my experts
    all_to_all_single(received, counts, group=group)
    sent_per_rank, received = counts.view(ranks, held), received.view(ranks, held)
    sent, got = torch.stack([sent_per_rank.sum(dim=1), received.sum(dim=1)]).tolist()  # the host needs the sizes
    incoming = all_to_all_single_autograd(rows, got, sent, group)
    incoming_weights = all_to_all_single_autograd(weights, got, sent, group)
    # what arrived is ordered by (source rank, expert): group it by expert for the grouped GEMM
    expert_of_row = torch.repeat_interleave(torch.arange(held, device=counts.device).repeat(ranks), received.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)
    from_expert = _inverse(by_expert)
    rows = _Reorder.apply(incoming, by_expert, from_expert)
    out = _experts_mlp(self, lambda weight, offsets: _product(rows, weight, offsets),
                       _Reorder.apply(incoming_weights, by_expert, from_expert),
                       torch.cumsum(received.sum(dim=0), dim=0, dtype=torch.int32), expert_of_row[by_expert])
    return all_to_all_single_autograd(_Reorder.apply(out, from_expert, by_expert), sent, got, group)


def _experts_mlp(self: nn.Module, first: Callable, weights: torch.Tensor, offsets: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor:
    """Each expert's MLP on its rows, times the rows' routing weights (``first(weight, offsets)``: the rows, grouped by
    expert, through the first projection; ``offsets``: int32, each expert held's end in the rows, ``expert_ids`` per
    row). The weight scales the down projection's input, not its output: the same product (the projection is linear;
    its bias is scaled on its own), without keeping the output for the weights' gradient."""
    dtype = weights.dtype
    hidden = first(_in_out(self.gate_up_proj if self.has_gate else self.up_proj, self.is_transposed, dtype), offsets)
    if self.has_bias:
        hidden = hidden + _held(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).index_select(0, expert_ids)
    hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
    weights = weights.unsqueeze(-1).to(hidden.dtype)
    out = _product(hidden * weights, _in_out(self.down_proj, self.is_transposed, dtype), offsets)
    if self.has_bias:
        out = out + _held(self.down_proj_bias).index_select(0, expert_ids) * weights
    return out


def _in_out(weight: torch.Tensor, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of a projection as (experts, in, out) in ``dtype`` (the compute dtype: autocast's, as
    autocast casts an nn.Linear's weight; its gradient reaches the float32 weight through the cast)."""
    weight = _held(weight)
    return (weight if transposed else weight.transpose(-2, -1)).to(dtype)


def _held(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight or bias: its local part when sharded over the expert-parallel ranks."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _product(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows (S, in), grouped by expert (``offsets``: their ends), through each expert's weight (experts, in, out)."""
    rows = rows.to(weight.dtype)
    if rows.device.type == "cuda":
        return torch.nn.functional.grouped_mm(rows, weight, offs=offsets)
    # CPU (tests, debugging): torch's grouped kernel there takes neither float32 nor unaligned sizes; a matmul an expert
    return torch.cat([rows[start:end] @ weight[index] for index, (start, end) in enumerate(_spans(offsets))])


def _weight_gradient(rows: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows (S, in)^T times its gradient rows (S, out): (experts, in, out)."""
    if rows.device.type == "cuda":
        return torch.nn.functional.grouped_mm(rows.t(), grad, offs=offsets)
    return torch.stack([rows[start:end].t() @ grad[start:end] for start, end in _spans(offsets)])


def _spans(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends], ends))


class _GatheredProduct(torch.autograd.Function):
    """``_product(tokens[order // k], weight, offsets)`` keeping the tokens, not their k gathered copies: the backward
    gathers them again (a copy, cheaper than keeping k x the tokens for the backward)."""

    @staticmethod
    def forward(ctx, tokens, order, back, top_k, weight, offsets):
        ctx.save_for_backward(tokens, order, back, weight, offsets)
        ctx.top_k = top_k
        return _product(_spread(tokens, order, top_k), weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tokens, order, back, weight, offsets = ctx.saved_tensors
        rows = _spread(tokens, order, ctx.top_k).to(weight.dtype)
        grad = grad.to(weight.dtype)
        grad_rows = _product(grad, weight.transpose(-2, -1), offsets)
        grad_tokens = _summed(grad_rows, back, ctx.top_k).to(tokens.dtype)
        return grad_tokens, None, None, None, _weight_gradient(rows, grad, offsets), None
