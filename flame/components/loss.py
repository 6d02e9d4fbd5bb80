"""Next-token cross entropy, summed: the trainer divides by the global count of real targets."""

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed CE (in fp32) over the targets that are not IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


def build_loss(job_config, **kwargs):
    """torchtitan TrainSpec hook: loss(model output or logits, labels)."""
    cross_entropy = cross_entropy_sum
    if job_config.compile.enable and "loss" in job_config.compile.components:
        cross_entropy = torch.compile(cross_entropy_sum, backend=job_config.compile.backend)

    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(getattr(output, "logits", output), labels)

    return loss
