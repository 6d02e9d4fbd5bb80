"""Context parallelism: every batch's tokens split over the CP ranks, documents kept exact.

Layout. A batch's rows are flattened into one stream of T tokens (no document crosses a
row, so nothing changes) and cut into parts. With the default load balancer ``headtail``
there are 2 x cp parts and rank r holds parts r and 2cp-1-r, front then back, so that every
rank gets as much causal attention work; with ``--parallelism.context_parallel_load_balancer
None``, rank r holds the r-th of cp contiguous parts. The input ids, labels and position ids
are sharded that way; the model gets this rank's tokens as one row, and ``cu_seqlens`` marks
the pieces of documents it holds.

Softmax attention (HF models through transformers' registry, fla's attention layers through
the flash-attn shims; both reach ``attention.document_attention``, which finds this layout in
the batch being computed (flame.base.batch_context), so no model needs code of its own). Each layer all-gathers K and V over the
CP group (backward: their gradients are reduce-scattered back), puts them in global token
order, and attends the local queries to them: the query at global position p of document d
sees the keys g of d with g <= p (and p - g < window) -- the mask one process would use.
- ``sdpa``: a dense [local tokens x T] mask (CPU debugging and tests);
- ``flex``: a block mask over (local query, global key);
- ``varlen``: each local piece of a document is one query sequence; its keys are its
  document from the start up to the piece's end (flash-attn aligns the queries to the end).
Rotary positions are right without help for HF models (position ids are sharded with the
tokens); fla's rotary counts positions from ``cu_seqlens``, so it is given each piece's
offset in its document.

fla linear attention (kda, gated_deltanet; NVIDIA GPUs): fla's context-parallel kernels
pass the recurrent state (and the short convolutions' previous tokens) between ranks;
flame hands the layers fla's ``FLACPContext`` for the same layout.

The loss: each rank's loss covers its tokens, divided by the step's global target count
(counted before sharding, over the data-parallel ranks); FSDP's mesh (torchtitan's ``fsdp`` =
dp_shard x cp) sums the gradients over the CP ranks as well; the trainer sums the logged loss
over the CP ranks, then over the data-parallel ranks.
"""

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.tools.logging import logger

from flame import compat

from flame.base import device
from flame.base.batch_context import documents_of
from flame.base.errors import ConfigError
from flame.models.kernels import attention
from flame.models.inputs import is_fla_model, uses_flame_attention
from flame.models.support import ContextParallelism, model_types_where, support_for

LOAD_BALANCERS = ("headtail", None)


def check_context_parallel(config, job_config) -> None:
    """Refuse a context-parallel run this model or layout cannot take, before any process group exists."""
    p, training = job_config.parallelism, job_config.training
    cp = p.context_parallel_degree
    if cp <= 1:
        return
    flag = f"--parallelism.context_parallel_degree {cp}"
    model_type, support = config.model_type, support_for(config)
    if support.context_parallel is ContextParallelism.NONE:
        can = ", ".join(model_types_where(lambda other: other.context_parallel is not ContextParallelism.NONE))
        raise ConfigError(
            f"{flag}: {model_type} cannot run context parallel (its token mixers would need the state or the tokens "
            f"of other ranks, which flame does not pass for it); types that can: {can}. "
            "Use data parallelism for it (--parallelism.context_parallel_degree 1)"
        )
    if support.context_parallel is ContextParallelism.FLA_KERNELS:
        if not device.CUDA:
            raise ConfigError(f"{flag}: {support.name} runs context parallel with fla's CP kernels, which need NVIDIA GPUs")
        if p.tensor_parallel_degree > 1:
            raise ConfigError(
                f"{flag}: fla's CP kernels with tensor parallelism are not verified for {model_type}; "
                "use one of them (--parallelism.tensor_parallel_degree 1)"
            )
    if p.context_parallel_load_balancer not in LOAD_BALANCERS:
        raise ConfigError(
            f"--parallelism.context_parallel_load_balancer {p.context_parallel_load_balancer}: flame balances "
            "context-parallel work with 'headtail' (the default) or not at all (None)"
        )
    if p.context_parallel_rotate_method != "allgather":
        raise ConfigError(
            f"--parallelism.context_parallel_rotate_method {p.context_parallel_rotate_method}: flame's context "
            "parallelism all-gathers K/V ('allgather', the default); leave it unset"
        )
    if p.pipeline_parallel_degree > 1:
        raise ConfigError(
            f"{flag} with --parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree}: flame cannot combine "
            "context and pipeline parallelism; use one of them"
        )
    tokens = training.local_batch_size * training.seq_len
    parts = 2 * cp if p.context_parallel_load_balancer else cp
    if tokens % parts:
        how = f"2 x cp = {parts} ('headtail' balancing)" if p.context_parallel_load_balancer else f"cp = {parts}"
        raise ConfigError(
            f"{flag}: a batch's {tokens} tokens (--training.batch_size x --training.seq_len) are not divisible by {how}; "
            "change --training.seq_len"
        )
    tp = p.tensor_parallel_degree
    if tp > 1 and (tokens // cp) % tp:
        raise ConfigError(
            f"{flag}: each rank's {tokens // cp} tokens are not divisible by --parallelism.tensor_parallel_degree {tp} "
            "(sequence parallelism splits them further); change --training.seq_len"
        )


def rank_intervals(total: int, size: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """The [start, end) ranges of the flattened batch that ``rank`` holds, in its local order."""
    if not balanced:
        part = total // size
        return [(rank * part, (rank + 1) * part)]
    part = total // (2 * size)
    back = 2 * size - 1 - rank
    return [(rank * part, (rank + 1) * part), (back * part, (back + 1) * part)]


@functools.lru_cache(maxsize=8)
def _token_layout(total: int, size: int, rank: int, balanced: bool, on: torch.device):
    """The global position of each local token (on ``on``), and the index in the rank-ordered
    all-gather of each global token (on ``on`` and as numpy), or None where that is the identity."""
    def positions(r):
        return np.concatenate([np.arange(a, b) for a, b in rank_intervals(total, size, r, balanced)])

    local = torch.from_numpy(positions(rank)).to(on)
    if not balanced:  # the all-gather is already in global order
        return local, None, None
    order = np.argsort(np.concatenate([positions(r) for r in range(size)]), kind="stable")
    return local, torch.from_numpy(order).to(on), order


def _all_gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's ``x`` along dim 0, in rank order; backward sums the ranks' gradients into each part."""
    gathered = DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()])
    return gathered.to_local(grad_placements=[Partial()])


@dataclass(eq=False)
class BatchLayout:
    """One batch under context parallelism, as this rank holds it (device tensors; Python ints for kernels)."""

    mesh: DeviceMesh | None  # the CP mesh (None: a layout computed for another rank, e.g. in tests)
    balanced: bool
    total: int  # tokens of the whole batch
    documents_cpu: torch.Tensor  # the batch's cu_seqlens (int64, CPU)
    documents: torch.Tensor  # index of the document of each of the T tokens
    positions: torch.Tensor  # global position of each local token
    order: torch.Tensor | None  # position in the all-gather of each global token; None: the same
    cu_seqlens: torch.Tensor  # the local pieces of documents (int32), what the model is given
    cu_seqlens_cpu: torch.Tensor
    piece_offsets: torch.Tensor  # each piece's first position within its document (int32)
    cu_seqlens_k: torch.Tensor  # varlen: each piece's keys (its document up to the piece's end)
    key_index: torch.Tensor | slice  # varlen: those keys' positions in the all-gather (a slice if contiguous)
    max_piece: int
    max_keys: int
    max_document: int
    _masks: dict = field(default_factory=dict)
    _fla_contexts: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls, cu_seqlens: torch.Tensor, total: int, size: int, rank: int, balanced: bool, mesh: DeviceMesh | None = None
    ) -> "BatchLayout":
        on = cu_seqlens.device
        cu = cu_seqlens.to("cpu", torch.int64)
        bounds = cu.numpy()
        starts, ends, document_starts, keys = [], [], [], []
        for a, b in rank_intervals(total, size, rank, balanced):
            first = int(np.searchsorted(bounds, a, side="right")) - 1
            inner = bounds[first + 1 : np.searchsorted(bounds, b, side="left")]  # document starts inside (a, b)
            edges = np.concatenate([[a], inner, [b]])
            starts.append(edges[:-1])
            ends.append(edges[1:])
            document_starts.append(np.concatenate([[bounds[first]], inner]))
            keys.append(np.arange(bounds[first], b))
        starts, ends, document_starts = np.concatenate(starts), np.concatenate(ends), np.concatenate(document_starts)
        positions, order, order_cpu = _token_layout(total, size, rank, balanced, on)
        key_index = np.concatenate(keys)
        if order_cpu is not None:
            key_index = order_cpu[key_index]
        contiguous = bool((np.diff(key_index) == 1).all())

        def cumulative(lengths):
            return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

        local = cumulative(ends - starts)

        return cls(
            mesh=mesh,
            balanced=balanced,
            total=total,
            documents_cpu=cu,
            documents=attention.document_ids(cu_seqlens, total),
            positions=positions,
            order=order,
            cu_seqlens=local.to(on),
            cu_seqlens_cpu=local,
            piece_offsets=torch.from_numpy((starts - document_starts).astype(np.int32)).to(on),
            cu_seqlens_k=cumulative(ends - document_starts).to(on),
            key_index=slice(int(key_index[0]), int(key_index[-1]) + 1) if contiguous else torch.from_numpy(key_index).to(on),
            max_piece=int((ends - starts).max()),
            max_keys=int((ends - document_starts).max()),
            max_document=int(np.diff(bounds).max()),
        )

    def shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of a per-token tensor of the batch (any shape of T elements), as one row."""
        return tokens.reshape(-1).index_select(0, self.positions)[None]

    # softmax attention of the local queries ([n, Hq, D]) against every key of their documents

    def attention(self, query, key, value, backend: str, scale: float | None, window: int | None) -> torch.Tensor:
        """The local queries' attention; ``key``/``value``: this rank's, all-gathered here."""
        key, value = _all_gather(key, self.mesh), _all_gather(value, self.mesh)
        return self.attend(query, key, value, backend, scale, window)

    def attend(self, query, key, value, backend: str, scale: float | None, window: int | None) -> torch.Tensor:
        """The local queries' attention to all ranks' keys/values, concatenated in rank order."""
        if backend == "varlen":
            key, value = key[self.key_index], value[self.key_index]
            return attention._varlen(
                query, key, value, self.cu_seqlens, self.cu_seqlens_k, self.max_piece, self.max_keys, scale, window
            )
        if self.order is not None:  # global token order
            key, value = key.index_select(0, self.order), value.index_select(0, self.order)
        if backend == "flex":
            return attention._flex_attention(query, key, value, self._mask("flex", window), scale)
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self._mask("dense", window), scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )
        return out[0].transpose(0, 1)

    def _mask(self, kind: str, window: int | None):
        if (kind, window) not in self._masks:
            positions, documents = self.positions, self.documents
            if kind == "dense":
                keys = torch.arange(self.total, device=positions.device)
                mask = attention._allowed(positions[:, None], keys[None, :], documents, window)
            else:
                mask = create_block_mask(
                    lambda b, h, q, k: attention._allowed(positions[q], k, documents, window),
                    None, None, len(positions), self.total, device=positions.device,
                )
            self._masks[kind, window] = mask
        return self._masks[kind, window]

    # fla

    def fla_context(self, conv1d_kernel_size: int | None):
        """fla's FLACPContext for this layout (for its CP kernels and short convolutions)."""
        if conv1d_kernel_size not in self._fla_contexts:
            from fla.ops.cp import build_cp_context

            context = build_cp_context(
                self.documents_cpu.to(self.positions.device),
                group=self.mesh.get_group(),
                conv1d_kernel_size=conv1d_kernel_size,
                cu_seqlens_cpu=self.documents_cpu,
                layout="zigzag" if self.balanced else "contiguous",
            )
            if not torch.equal(context.cu_seqlens_cpu.long(), self.cu_seqlens_cpu.long()):
                raise RuntimeError("fla's context-parallel layout differs from flame's; this is a bug in flame")
            self._fla_contexts[conv1d_kernel_size] = context
        return self._fla_contexts[conv1d_kernel_size]


class ContextParallel:
    """Shards each batch over the CP ranks; the layout it returns goes into the batch's context."""

    def __init__(self, mesh: DeviceMesh, balanced: bool):
        self.mesh, self.balanced = mesh, balanced

    @classmethod
    def build(cls, model: nn.Module, parallel_dims, job_config) -> "ContextParallel | None":
        if not parallel_dims.cp_enabled:
            return None
        if is_fla_model(model):
            _install_in_fla(model)
        elif not uses_flame_attention(model):
            raise ConfigError(
                f"--parallelism.context_parallel_degree: {model.config.model_type} did not take flame's attention, "
                "which context parallelism needs"
            )
        balancer = job_config.parallelism.context_parallel_load_balancer
        logger.info(f"Context parallel over {parallel_dims.get_mesh('cp').size()} ranks ({balancer or 'contiguous'} layout)")
        return cls.of_run(parallel_dims, job_config)

    @classmethod
    def of_run(cls, parallel_dims, job_config) -> "ContextParallel | None":
        """The sharding of this run's batches (None without context parallelism); ``build`` readies the model too."""
        if not parallel_dims.cp_enabled:
            return None
        balanced = job_config.parallelism.context_parallel_load_balancer is not None
        return cls(parallel_dims.get_mesh("cp"), balanced=balanced)

    def shard(self, batch: dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor, BatchLayout]:
        """This rank's part of the batch, and its layout (for the batch's context: flame.base.batch_context).

        The batch's documents are read on the CPU (a small sync).
        """
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        layout = BatchLayout.build(batch["cu_seqlens"], labels.numel(), size, rank, self.balanced, self.mesh)
        sharded = {**batch, "cu_seqlens": layout.cu_seqlens}
        for name in ("input", "position_ids"):
            sharded[name] = layout.shard(batch[name])
        return sharded, layout.shard(labels), layout


# fla: its layers pass cu_seqlens to their rotary, short convolutions and kernels; under
# context parallelism those calls get the batch's offsets / FLACPContext as well.


def _context(cu_seqlens) -> BatchLayout | None:
    """The layout of the batch being computed, for a call given that batch's documents."""
    batch = documents_of(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else None
    return batch.context_parallel if batch is not None else None


def _rotary_forward(original):
    @torch.compiler.disable
    def forward(q, k, seqlen_offset=0, cu_seqlens=None, max_seqlen=None, **kwargs):
        layout = _context(cu_seqlens)
        if layout is not None and isinstance(seqlen_offset, int) and seqlen_offset == 0:
            seqlen_offset = layout.piece_offsets  # a piece continuing a document starts at its offset
            max_seqlen = max(max_seqlen or 0, layout.max_document)
        return original(q, k, seqlen_offset=seqlen_offset, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)

    return forward


def _convolution_forward(original, kernel_size: int):
    @torch.compiler.disable
    def forward(*args, **kwargs):
        layout = _context(kwargs.get("cu_seqlens"))
        if layout is not None:
            kwargs["cp_context"] = layout.fla_context(kernel_size)  # the previous rank's last tokens
        return original(*args, **kwargs)

    return forward


def _kernel(op):
    @torch.compiler.disable
    @functools.wraps(op)
    def call(*args, **kwargs):
        layout = _context(kwargs.get("cu_seqlens"))
        if layout is not None:
            kwargs["cp_context"] = layout.fla_context(None)  # the state passes between ranks
        return op(*args, **kwargs)

    return call


def _install_in_fla(model: nn.Module) -> None:
    from fla.modules import RotaryEmbedding, ShortConvolution

    compat.fla.kernels_take_cp_context(_kernel)  # kda's and gated_deltanet's chunk kernels
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.forward = _rotary_forward(module.forward)
        elif isinstance(module, ShortConvolution):
            module.forward = _convolution_forward(module.forward, module.kernel_size[0])
