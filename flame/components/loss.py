"""Next-token cross entropy, summed: the trainer divides by the global count of real targets.

Two ways to get there:
- from logits (``cross_entropy_sum``): the model's lm_head produces all logits, tokens x vocab;
- fused (``LossHead``): the lm_head computes the loss from the last hidden states chunk by
  chunk, so the full logits (and their gradient) never exist. At 64K tokens x 32K vocab that
  is 8 GiB of fp32 logits not allocated. CUDA uses fla's fused linear-cross-entropy kernel,
  other devices a chunked PyTorch version whose chunks are recomputed in backward.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchtitan.components.loss import IGNORE_INDEX

# tokens per chunk of the PyTorch fallback: 4096 x 32K vocab x 4 bytes = 512 MiB of logits at a time
CHUNK_TOKENS = 4096


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed CE (in fp32) over the targets that are not IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def _chunk_cross_entropy_sum(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_INDEX)


def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """sum CE(hidden @ weight.T + bias, targets), holding one chunk of logits at a time."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for hidden_chunk, target_chunk in zip(hidden.split(CHUNK_TOKENS), targets.split(CHUNK_TOKENS)):
        total = total + checkpoint(_chunk_cross_entropy_sum, hidden_chunk, weight, bias, target_chunk, use_reentrant=False)
    return total


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """Summed CE of the logits ``hidden @ weight.T + bias`` (``[N, H]`` hidden, ``[N]`` targets)."""
    if torch.is_autocast_enabled(hidden.device.type):  # match what F.linear would compute in
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if hidden.is_cuda:
        from fla.modules.fused_linear_cross_entropy import (
            fused_linear_cross_entropy_loss,
        )

        return fused_linear_cross_entropy_loss(
            hidden.contiguous(), targets, weight, bias, ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return chunked_linear_cross_entropy_sum(hidden, weight, bias, targets)


class LossHead(nn.Linear):
    """An lm_head that, when given targets, returns their summed cross entropy instead of logits.

    flame swaps the class of the model's own ``nn.Linear`` head (same Parameter objects, so
    state dicts, tied embeddings, FSDP and exports see no difference) and sets ``targets``
    right before each training forward. The model's forward is untouched: what it returns
    as "logits" is then the 0-dim loss, which the loss function passes on.
    """

    targets: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        targets, self.targets = self.targets, None
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy_sum(hidden.flatten(0, -2), self.weight, self.bias, targets.flatten())


def use_fused_cross_entropy(model: nn.Module) -> LossHead:
    """Make the model's lm_head a LossHead; ValueError if its head is not a plain Linear."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"its lm_head is a {type(head).__name__}, not an nn.Linear")
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(model.config, attribute, None) not in (None, 1, 1.0):
            raise ValueError(f"it post-processes logits ({attribute})")
    head.__class__ = LossHead
    return head


def build_loss(job_config, **kwargs):
    """torchtitan TrainSpec hook: loss(model output or logits, labels)."""
    cross_entropy = cross_entropy_sum
    if job_config.compile.enable and "loss" in job_config.compile.components:
        cross_entropy = torch.compile(cross_entropy_sum, backend=job_config.compile.backend)

    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        if logits.ndim == 0:  # a LossHead already computed the summed loss
            return logits
        return cross_entropy(logits, labels)

    return loss
