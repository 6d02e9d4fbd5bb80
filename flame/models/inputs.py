"""What each model family takes from a batch besides the input ids."""

import torch
from torch import nn


def is_fla_model(model: nn.Module) -> bool:
    return type(model.config).__module__.startswith("fla.")


def forward_kwargs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``model(input_ids, **kwargs)``.

    HF models get position ids that restart at every document segment; transformers'
    SDPA path turns restarting position ids into a block-diagonal (document) causal mask.
    fla models take ``cu_seqlens`` in varlen batches (one row) and see the row as one
    sequence otherwise.
    """
    if is_fla_model(model):
        single_row = batch["input"].shape[0] == 1
        return {"cu_seqlens": batch["cu_seqlens"]} if single_row else {}
    return {"position_ids": batch["position_ids"]}
