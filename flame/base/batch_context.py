"""The batch being computed: what a model's layers need from it beyond their own arguments.

A packed batch's document layout has to reach code that flame does not call itself:
- the attention functions fla's layers call through flash-attn's API, whose arguments carry
  the documents' ``cu_seqlens`` but only an upper bound of the longest document (the varlen
  kernel sizes its grid by it; finding the exact value on the GPU would cost a sync per layer);
- under context parallelism, fla's rotary embeddings, short convolutions and kernels, which
  need this rank's share of the documents (flame.distributed.context_parallel);
- fla's chunk kernels, which size their outputs by the documents' chunk count and read it from
  a GPU tensor (a sync per call); the host's copy of ``cu_seqlens`` spares that (flame.compat.fla);
- a fused loss head (flame.models.loss.LossHead) inside the model's forward: HF's forward
  hands its lm_head the hidden states only, so the targets cannot travel as an argument.

flame hands these over in one object, the ``BatchContext``, active while the batch's forward
and backward run (activation checkpointing recomputes inside that backward):

    with batch_context.computing(BatchContext(...)):
        loss = loss_fn(model(inputs, **kwargs), labels) / global_valid_tokens
        loss.backward()

The trainer makes one per micro-batch; under pipeline parallelism one for the whole step (its
loss normalization) and, inside it, one per stage forward (that micro-batch's documents and
targets). Readers call ``current()``. Everything in it is an optimization or the batch's own
data: without an active batch (``generate``, a recompute outside any forward), attention
uses the bound it was given and builds its masks itself, and a loss head returns logits.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class BatchContext:
    """One batch as the model's layers see it (device tensors; Python ints for kernel grids)."""

    cu_seqlens: torch.Tensor | None = None  # the attention segments' starts over the flattened batch (+ total)
    cu_seqlens_host: list[int] | None = None  # the same as Python ints, read before the batch left the CPU
    max_seqlen: int | None = None  # the longest segment
    targets: torch.Tensor | None = None  # the labels, for a fused loss head (None: the model returns logits)
    global_valid_tokens: torch.Tensor | None = None  # the step's real targets over all data-parallel ranks
    context_parallel: Any = None  # this rank's share of the batch (flame.distributed.context_parallel.BatchLayout)
    # what the layers derive from the documents, by the first layer that needs it: attention masks, chunk totals
    masks: dict = field(default_factory=dict)

    def replace(self, **changes) -> "BatchContext":
        """A context for part of this batch (a pipeline micro-batch): the given fields replaced, no masks.

        New ``cu_seqlens`` without their host copy leave none: the old one describes other documents."""
        if "cu_seqlens" in changes:
            changes.setdefault("cu_seqlens_host", None)
        return dataclasses.replace(self, **changes, masks={})


_current: BatchContext | None = None


@contextlib.contextmanager
def computing(batch: BatchContext) -> Iterator[BatchContext]:
    """Make ``batch`` the one being computed while the block runs (nested: the inner one wins)."""
    global _current
    outer, _current = _current, batch
    try:
        yield batch
    finally:
        _current = outer


def current() -> BatchContext | None:
    """The batch being computed, or None outside any."""
    return _current


def host_chunk_total(cu_seqlens: torch.Tensor, chunk_size: int) -> int | None:
    """How many ``chunk_size`` chunks the documents of ``cu_seqlens`` split into (each document's rounded up), from the
    host's copy when they are the active batch's documents (reading a GPU tensor's values would wait for the GPU);
    None otherwise. Counted once per batch and chunk size."""
    batch = _current
    if batch is None or batch.cu_seqlens is not cu_seqlens or batch.cu_seqlens_host is None:
        return None
    key = ("chunk total", chunk_size)
    if key not in batch.masks:
        bounds = batch.cu_seqlens_host
        batch.masks[key] = sum(-((start - end) // chunk_size) for start, end in zip(bounds, bounds[1:]))  # ceil
    return batch.masks[key]


def documents_of(cu_seqlens: torch.Tensor) -> BatchContext | None:
    """The active batch, when ``cu_seqlens`` describes its documents; None outside any batch.

    An attention call inside an active batch gets that batch's ``cu_seqlens`` (flame passes them
    to the model); one of another size is a bug, raised rather than computed with the wrong masks.
    """
    batch = _current
    if batch is None or batch.cu_seqlens is None:
        return None
    if cu_seqlens.shape != batch.cu_seqlens.shape:
        raise RuntimeError(
            f"attention got {cu_seqlens.numel() - 1} documents inside a batch of {batch.cu_seqlens.numel() - 1}; "
            "this is a bug in flame"
        )
    return batch
