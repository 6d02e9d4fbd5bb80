"""What each model family takes from a batch: input ids, and how the documents are marked.

A batch holds rows of packed documents: ``position_ids`` restart at every document and
``cu_seqlens`` marks the document boundaries over the flattened batch (see flame.data.packing).
- HF models get the position ids (rotary positions restart per document) and, when they use
  flame's attention, ``cu_seq_lens_q``, which that attention masks documents by. Other
  attention implementations turn restarting position ids into a document mask themselves.
- fla models take documents only as ``cu_seqlens`` over a single row, so the batch is
  flattened into one row (same tokens, same targets, documents never cross rows anyway).
  The fla types that cannot isolate documents (their records in flame.models.support) get the
  rows as they are, each row one sequence.
"""

import torch
from torch import nn

from flame.base.batch_context import BatchContext
from flame.models.kernels import attention
from flame.models.support import Documents, support_for


def is_fla_config(config) -> bool:
    return type(config).__module__.startswith("fla.")


def is_fla_model(model: nn.Module) -> bool:
    return is_fla_config(model.config)


def uses_flame_attention(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == attention.HF_ATTENTION


def keeps_rows_whole(config) -> bool:
    """Model types that cannot isolate documents take each row as one sequence (their positions run over it)."""
    return support_for(config).documents is Documents.ROWS_WHOLE


def flattens_rows(model: nn.Module) -> bool:
    """Model types that take documents as ``cu_seqlens`` (fla's) take a batch as one row."""
    return support_for(model.config).documents is Documents.CU_SEQLENS


def document_kwargs(model: nn.Module, batch: dict) -> dict:
    """The keyword inputs telling ``model`` where the batch's attention segments are.

    ``cu_seqlens`` always describes the attention segments: the documents, or with
    --training.no-document_mask the context_len pieces of each row.
    """
    cu_seqlens = batch["cu_seqlens"]
    # The number of documents changes every batch: compiled blocks get one graph for any count. "maybe":
    # a row of one document (cu_seqlens of 2) makes its graph specialize on that count (size-1 differences
    # broadcast), which mark_dynamic would turn into an error; the one-document graph is compiled once more.
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    # no KV cache in training: it costs memory, and activation checkpointing's recompute would append to it
    if is_fla_model(model):
        return {"cu_seqlens": cu_seqlens, "use_cache": False} if flattens_rows(model) else {"use_cache": False}
    kwargs = {"position_ids": batch["position_ids"], "use_cache": False}
    if uses_flame_attention(model):
        kwargs["cu_seq_lens_q"] = cu_seqlens
    return kwargs


def segments_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest segment) of a batch whose position ids restart at every segment (on the CPU)."""
    starts = torch.nonzero(position_ids.flatten() == 0).flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([position_ids.numel()])]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def to_device(batch: dict, device: torch.device, keep_on_cpu: frozenset[str] = frozenset()) -> dict:
    """The loader's batch with its tensors on ``device`` (but ``keep_on_cpu``'s), and ``cu_seqlens_host``: the
    documents' boundaries as Python ints, read here while they are still on the CPU (no sync)."""
    moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) and k not in keep_on_cpu else v
             for k, v in batch.items()}
    if torch.is_tensor(batch.get("cu_seqlens")) and batch["cu_seqlens"].device.type == "cpu":
        moved["cu_seqlens_host"] = batch["cu_seqlens"].tolist()
    return moved


def model_inputs(model: nn.Module, batch: dict, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input ids, labels, keyword inputs) for ``model(input_ids, **kwargs)``.

    fla types that cannot isolate documents (flame.models.support) get the rows as they
    are: their state restarts at each row.
    """
    kwargs = document_kwargs(model, batch)
    if flattens_rows(model):
        return batch["input"].reshape(1, -1), labels.reshape(1, -1), kwargs
    return batch["input"], labels, kwargs


def batch_inputs(
    model: nn.Module, batch: dict, labels: torch.Tensor, step: BatchContext, context_parallel=None
) -> tuple[torch.Tensor, torch.Tensor, dict, BatchContext]:
    """(input ids, labels, keyword inputs, the batch's context) for one batch through a whole (not pipelined) model.

    Under context parallelism (a flame.distributed.context_parallel.ContextParallel), this rank's
    share of the tokens; the context (within ``step``'s) holds the batch's documents and, for a
    fused loss head, its targets. Training and validation compute their batches alike.
    """
    # here, not at the top: flame.models must import without torchtitan (flame.register() for exports)
    from flame.models.loss import LossHead

    layout = None
    if context_parallel is not None:
        batch, labels, layout = context_parallel.shard(batch, labels)
    inputs, labels, kwargs = model_inputs(model, batch, labels)
    fused_loss = isinstance(model.get_output_embeddings(), LossHead)  # the head returns the loss (fused CE)
    context = step.replace(
        cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"], targets=labels if fused_loss else None,
        context_parallel=layout, cu_seqlens_host=batch.get("cu_seqlens_host") if layout is None else None,
    )
    return inputs, labels, kwargs, context
