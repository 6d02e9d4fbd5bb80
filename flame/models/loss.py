"""Next-token cross entropy, summed: the trainer divides by the global count of real targets.

Two ways to get there:
- from logits (``cross_entropy_sum``): the model's lm_head produces all logits, tokens x vocab;
- fused (``LossHead``): the lm_head computes the loss from the last hidden states chunk by
  chunk, so the full logits (and their gradient) never exist. At 64K tokens x 32K vocab that
  is 8 GiB of fp32 logits (and more for their gradient) not allocated.

Under tensor parallelism the lm_head holds a shard of the vocabulary on each rank. The logits
path then uses torch's ``loss_parallel`` (logits stay sharded over the vocabulary); the fused
path computes a vocabulary-parallel chunked cross entropy: each rank scores all tokens against
its vocabulary rows, and per chunk two small all-reduces (the max, then the sum of exponentials
and the target logits) give every rank the same log-partition and loss. Gradients stay local:
each rank's weight gradient covers its rows, and its partial hidden-state gradient is summed
over the ranks by the all-gather that brought the hidden states in.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torchtitan.components.loss import IGNORE_INDEX

from flame.base import batch_context
from flame.models import moe
from flame.models.model_config import load_model_config

# tokens per chunk: 8192 x 32K vocab x 4 bytes = 1 GiB of fp32 logits at a time
CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class LogitTerms:
    """What the loss adds to the cross entropy (--training.z_loss, --training.logit_softcap).

    z_loss: z x log(Z)^2 per target, Z the softmax's normalizer (PaLM's 1e-4): keeps log(Z) near 0, so the
    logits cannot drift up together. softcap: the logits pass through c x tanh(logit / c) first (Gemma 2's 30),
    bounding them at +-c. Both are computed inside each chunk of the fused cross entropy (and of its
    vocabulary-parallel form) and on the logits path alike; the z term's sum is kept for the log.
    """

    z_loss: float = 0.0
    softcap: float = 0.0


_terms = LogitTerms()
_z_sum: torch.Tensor | None = None  # the z terms summed since the last take_z_sum(), detached


def set_logit_terms(terms: LogitTerms) -> None:
    """This process's terms (build_loss sets them from the job, before any forward)."""
    global _terms
    _terms = terms


def _add_z(z_sum: torch.Tensor) -> None:
    global _z_sum
    _z_sum = z_sum.detach() if _z_sum is None else _z_sum + z_sum.detach()


def take_z_sum() -> torch.Tensor | None:
    """The z terms summed over the targets computed since the last call (None when z_loss is off)."""
    global _z_sum
    taken, _z_sum = _z_sum, None
    return taken


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, terms: LogitTerms | None = None,
                      compute=None) -> torch.Tensor:
    """Summed CE (in fp32) over the targets that are not IGNORE_INDEX, with the z term and softcap of ``terms``
    (``compute``: a compiled ``_cross_entropy_and_z``)."""
    terms = terms or _terms
    loss, z_sum = (compute or _cross_entropy_and_z)(logits, labels, terms.z_loss, terms.softcap)
    if terms.z_loss:
        _add_z(z_sum)
    return loss


def _cross_entropy_and_z(logits: torch.Tensor, labels: torch.Tensor, z_loss: float,
                         softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _capped(logits.flatten(0, 1).float(), softcap)
    targets = labels.flatten(0, 1)
    loss = F.cross_entropy(scores, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    if not z_loss:
        return loss, torch.zeros((), device=loss.device)
    z_sum = (z_loss * torch.logsumexp(scores, dim=-1) ** 2 * (targets != IGNORE_INDEX)).sum()
    return loss + z_sum, z_sum


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
                         softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed CE of one chunk of logits (plus the z term), its gradient in the logits' dtype, and the z term's sum.

    d/d scores = softmax x (1 + 2 z log Z) - one-hot; under a softcap, times 1 - (capped / c)^2.
    """
    scores = _capped(logits.float(), softcap)
    keep = targets != IGNORE_INDEX
    safe_targets = torch.where(keep, targets, 0)
    log_z = torch.logsumexp(scores, dim=-1)
    z_sum = (z_loss * log_z**2 * keep).sum()
    loss = ((log_z - scores.gather(1, safe_targets[:, None])[:, 0]) * keep).sum() + z_sum
    grad = torch.exp(scores - log_z[:, None]) * (1 + 2 * z_loss * log_z[:, None])
    grad = grad.scatter_add(1, safe_targets[:, None], -torch.ones_like(log_z[:, None]))
    if softcap:
        grad = grad * (1 - (scores / softcap) ** 2)
    return loss, (grad * keep[:, None]).to(logits.dtype), z_sum


_compiled_chunk_loss_and_grad = None


def _chunk_function(device: torch.device):
    # On CUDA the elementwise chain is compiled into a couple of kernels (fewer passes over
    # the chunk's logits); CPU runs it eagerly (debug runs; no compiler toolchain needed).
    global _compiled_chunk_loss_and_grad
    if device.type != "cuda":
        return _chunk_loss_and_grad
    if _compiled_chunk_loss_and_grad is None:
        _compiled_chunk_loss_and_grad = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk_loss_and_grad


def _shard_sums(scores, shift, local_targets, mine):
    sum_exp = torch.exp(scores - shift[:, None]).sum(-1)
    target_logit = scores.gather(1, local_targets[:, None])[:, 0] * mine
    return torch.stack([sum_exp, target_logit])


def _shard_loss_and_grad(scores, shift, sums, local_targets, mine, keep, dtype, z_loss, softcap):
    log_z = shift + sums[0].log()
    z_sum = (z_loss * log_z**2 * keep).sum()
    loss = ((log_z - sums[1]) * keep).sum() + z_sum
    grad = torch.exp(scores - log_z[:, None]) * (1 + 2 * z_loss * log_z[:, None])
    grad = grad.scatter_add(1, local_targets[:, None], -mine[:, None].to(grad.dtype))
    if softcap:
        grad = grad * (1 - (scores / softcap) ** 2)
    return loss, (grad * keep[:, None]).to(dtype), z_sum


_compiled_shard_functions = None


def _vocab_shard_chunk_loss_and_grad(logits, targets, z_loss, softcap, group, vocab_start):
    """``_chunk_loss_and_grad`` for logits over this rank's vocabulary rows [vocab_start, +n)."""
    global _compiled_shard_functions
    sums_fn, loss_and_grad_fn = _shard_sums, _shard_loss_and_grad
    if logits.device.type == "cuda":  # as _chunk_function: the elementwise pieces compiled on CUDA
        if _compiled_shard_functions is None:
            _compiled_shard_functions = tuple(torch.compile(f, dynamic=False) for f in (_shard_sums, _shard_loss_and_grad))
        sums_fn, loss_and_grad_fn = _compiled_shard_functions
    scores = _capped(logits.float(), softcap)
    keep = targets != IGNORE_INDEX
    local_targets = targets - vocab_start
    mine = keep & (local_targets >= 0) & (local_targets < scores.shape[1])
    local_targets = torch.where(mine, local_targets, 0)
    shift = scores.max(-1).values  # one shift on all ranks (the global max) keeps exp() in range
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    sums = sums_fn(scores, shift, local_targets, mine)
    dist.all_reduce(sums, group=group)  # sum of exponentials and the target logit, over the vocabulary
    return loss_and_grad_fn(scores, shift, sums, local_targets, mine, keep, logits.dtype, z_loss, softcap)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum CE(hidden @ weight.T + bias, targets), one chunk of logits at a time.

    The gradients are computed in the forward pass, chunk by chunk (d loss / d logits =
    softmax - one-hot), so backward only scales them: the same three matmuls as logits + CE,
    with no logits kept and none recomputed (faster than logits + CE and than fla's fused kernel
    at 64K tokens x 32K vocab: docs/perf-log-archive.md). ``chunk_loss_and_grad`` computes one
    chunk's loss and logit gradient: over the whole vocabulary, or over a tensor-parallel shard.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_loss_and_grad, terms):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        # a frozen head (LoRA) needs no weight gradient: neither its matmul nor its fp32 buffer
        train_head = ctx.needs_input_grad[1]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if train_head else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], CHUNK_TOKENS):
            h, t = hidden[start : start + CHUNK_TOKENS], targets[start : start + CHUNK_TOKENS]
            loss, grad_logits, z_sum = chunk_loss_and_grad(F.linear(h, weight, bias), t, terms.z_loss, terms.softcap)
            total += loss
            z_total += z_sum
            grad_hidden[start : start + CHUNK_TOKENS] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ h).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        if terms.z_loss:
            _add_z(z_total)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        grad_weight = (grad_weight * grad_output).to(weight_dtype) if grad_weight is not None else None
        grad_bias = (grad_bias * grad_output).to(bias_dtype) if grad_bias is not None else None
        return grad_hidden * grad_output.to(grad_hidden.dtype), grad_weight, grad_bias, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    chunk_loss_and_grad=None, terms: LogitTerms | None = None,
) -> torch.Tensor:
    """Summed CE of the logits ``hidden @ weight.T + bias`` (``[N, H]`` hidden, ``[N]`` targets)."""
    if torch.is_autocast_enabled(hidden.device.type):  # compute in what F.linear would use
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    chunk_loss_and_grad = chunk_loss_and_grad or _chunk_function(hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_loss_and_grad, terms or _terms)


def vocab_parallel_linear_cross_entropy_sum(
    hidden: DTensor, weight: DTensor, bias: DTensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """``linear_cross_entropy_sum`` under tensor parallelism, the same loss on every rank.

    ``weight``/``bias``: vocabulary rows sharded evenly over a 1-D mesh; ``hidden``: replicated
    (all tokens, ``[..., H]``); ``targets``: the same on every rank.
    """
    mesh = weight.device_mesh
    local_weight = weight.to_local()
    chunk = functools.partial(
        _vocab_shard_chunk_loss_and_grad, group=mesh.get_group(), vocab_start=mesh.get_local_rank() * local_weight.shape[0]
    )
    # d loss / d hidden from this rank's rows only: a partial sum, reduced by hidden's redistribution
    local_hidden = hidden.to_local(grad_placements=[Partial()])
    local_bias = bias.to_local() if bias is not None else None
    return linear_cross_entropy_sum(local_hidden.flatten(0, -2), local_weight, local_bias, targets.flatten(), chunk)


class LossHead(nn.Linear):
    """An lm_head that, inside a batch with targets, returns their summed cross entropy instead of logits.

    flame puts it in place of the model's own ``nn.Linear`` head, holding the same Parameter
    objects (so state dicts, tied embeddings, FSDP and exports see no difference). The targets
    come from the batch being computed (flame.base.batch_context: HF's forward hands its head
    the hidden states only); the model's forward is untouched: what it returns as "logits" is
    then the 0-dim loss, which the loss function passes on. Outside such a batch it is the
    plain linear head (evaluation, ``generate``).
    """

    @classmethod
    def sharing_parameters_of(cls, head: nn.Linear) -> "LossHead":
        with torch.device("meta"):  # no memory: the parameters are replaced by the head's own
            loss_head = cls(head.in_features, head.out_features, bias=head.bias is not None)
        loss_head.weight = head.weight
        loss_head.bias = head.bias
        return loss_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch = batch_context.current()
        targets = batch.targets if batch is not None else None
        if targets is None:
            return super().forward(hidden)
        if isinstance(self.weight, DTensor):  # tensor parallel: this rank holds a vocabulary shard
            return vocab_parallel_linear_cross_entropy_sum(hidden, self.weight, self.bias, targets)
        return linear_cross_entropy_sum(hidden.flatten(0, -2), self.weight, self.bias, targets.flatten())


def use_fused_cross_entropy(model: nn.Module) -> LossHead:
    """Put a LossHead in place of the model's lm_head; ValueError if its head is not a plain Linear."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"its lm_head is a {type(head).__name__}, not an nn.Linear")
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(model.config, attribute, None) not in (None, 1, 1.0):
            raise ValueError(f"it post-processes logits ({attribute})")
    loss_head = LossHead.sharing_parameters_of(head)
    name = next(name for name, module in model.named_modules() if module is head)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, loss_head)
    return loss_head


def with_router_term(loss: torch.Tensor, routing: "moe.Routing | None", labels: torch.Tensor) -> torch.Tensor:
    """``loss`` (summed over the targets) with a MoE model's load-balancing term, in training."""
    term = routing.loss_term(labels) if routing is not None else None
    return loss if term is None else loss + term


def build_loss(job_config, **kwargs):
    """torchtitan TrainSpec hook: loss(model output or logits, labels); sets the job's z-loss and softcap. A MoE
    model's load-balancing loss is added to it in training (flame.models.moe)."""
    set_logit_terms(LogitTerms(job_config.training.z_loss, job_config.training.logit_softcap))
    parallel_dims = kwargs.get("parallel_dims")
    balanced = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None  # data x context ranks
    routing = moe.Routing.of(load_model_config(job_config.model.config), balanced and balanced.get_group())
    cross_entropy = cross_entropy_sum
    if job_config.compile.enable and "loss" in job_config.compile.components:
        compiled = torch.compile(_cross_entropy_and_z, backend=job_config.compile.backend)
        cross_entropy = functools.partial(cross_entropy_sum, compute=compiled)

    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        if logits.ndim == 0:  # a LossHead already computed the summed loss
            return with_router_term(logits, routing, labels)
        loss = cross_entropy(logits, labels)
        # logits sharded over the vocabulary (tensor parallel, under loss_parallel): every rank
        # holds the whole sum
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        return with_router_term(loss, routing, labels)

    return loss
