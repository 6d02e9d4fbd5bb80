"""What streaming the weights over several processes adds (flame.optim.streaming): each process holds a shard of
every master, FSDP's split of dim 0 (stream_units), and ``Shards`` turns them into a block's weights and its
gradients back into shards.

- Up: a rank's shard layout (its chunks of the unit's masters, one after another) in the compute dtype,
  all-gathered; the ranks' layouts side by side are copied out into the block's buffer, each parameter's chunks
  being its rows in order (the padding at the end).
- Down: the block's gradients packed the same way (ranks x the trainable chunks, padding zero) and
  reduce-scattered, summed (flame normalizes the loss by the global token count), in ``reduce_dtype``; each rank
  lands its chunks.
- The masters become DTensors sharded as FSDP2's (``Shard(0)``), and so their optimizer state: a checkpoint
  resumes on any number of processes, streamed or not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from flame.base.errors import ConfigError
from flame.optim.stream_units import Unit, shard_shape


class Shards:
    """The data-parallel processes of ``mesh`` sharing a streamed model's weights."""

    def __init__(self, mesh, reduce_dtype: torch.dtype):
        self.mesh, self.reduce_dtype = mesh, reduce_dtype
        self.group = mesh.get_group()
        self.ranks, self.rank = mesh.size(), mesh.get_local_rank()

    def check(self, unit: Unit) -> None:
        if (scalar := next((m for m in unit.masters if m.dim() == 0), None)) is not None:
            raise ConfigError(f"--memory.stream_weights over {self.ranks} processes shards each parameter's first "
                             f"dimension, and {unit.name} has a scalar parameter ({tuple(scalar.shape)}): run one "
                             "process, or shard the model with FSDP")

    def take(self, unit: Unit, index: int, view: torch.Tensor) -> None:
        """The unit's ``index``-th master (whole, as initialized) keeps this rank's rows in ``view`` (its place in
        the pinned buffer) and becomes their DTensor, in every place the model holds it."""
        master = unit.masters[index]
        first = self.rank * shard_shape(master.shape, self.ranks, 0)[0]
        view.copy_(master[first : first + view.shape[0]])
        sharded = nn.Parameter(DTensor.from_local(view, self.mesh, [Shard(0)], run_check=False, shape=master.shape,
                                                  stride=master.stride()), requires_grad=master.requires_grad)
        sharded.__dict__.update(master.__dict__)  # what the model marked on it (HF's init flags, say)
        for owner, attr in unit.places[index]:
            owner._parameters[attr] = sharded
        unit.masters[index] = sharded

    def gather(self, unit: Unit, shard: torch.Tensor, full: torch.Tensor) -> None:
        """The ranks' ``shard`` layouts all-gathered into ``full``, the unit's buffer (on the current stream)."""
        gathered = torch.empty(self.ranks * unit.shard_numel, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(gathered, shard, group=self.group)
        ranked = gathered.view(self.ranks, unit.shard_numel)
        for offset, shard_offset, chunk, master in zip(unit.offsets, unit.shard_offsets, unit.chunks, unit.masters):
            _copy_chunks(full[offset : offset + master.numel()], ranked[:, shard_offset : shard_offset + chunk],
                         into_chunks=False)

    def reduce(self, unit: Unit, grads: list[torch.Tensor]) -> torch.Tensor:
        """The trainable masters' full gradients (``grads``, in their order), summed over the ranks: this rank's
        chunks, flat in ``reduce_dtype`` (on the current stream)."""
        packed = torch.empty(self.ranks, unit.grad_numel, dtype=self.reduce_dtype, device=grads[0].device)
        for (index, grad_offset), grad in zip(unit.grad_offsets.items(), grads):
            _copy_chunks(grad.reshape(-1), packed[:, grad_offset : grad_offset + unit.chunks[index]], into_chunks=True)
        summed = torch.empty(unit.grad_numel, dtype=self.reduce_dtype, device=packed.device)
        dist.reduce_scatter_tensor(summed, packed.view(-1), op=dist.ReduceOp.SUM, group=self.group)
        return summed

    def total(self, squares: torch.Tensor) -> torch.Tensor:
        """The ranks' ``squares`` (of their chunks' gradients) summed."""
        squares = squares.clone()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        return squares


def _copy_chunks(flat: torch.Tensor, chunks: torch.Tensor, into_chunks: bool) -> None:
    """Copy between a parameter's ``flat`` elements and its per-rank ``chunks`` (ranks x chunk: whole chunks, then
    the last one's part, then padding): into the chunks (the padding zeroed), or out of them into ``flat``."""
    chunk = chunks.shape[1]
    if chunk == 0:
        return
    whole, rest = divmod(flat.numel(), chunk)
    pairs = [(flat[: whole * chunk].view(whole, chunk), chunks[:whole])]
    if rest:
        pairs.append((flat[whole * chunk :], chunks[whole, :rest]))
    for elements, part in pairs:
        if into_chunks:
            part.copy_(elements)
        else:
            elements.copy_(part)
    if into_chunks and whole < chunks.shape[0]:  # the padding: the last chunk's tail, and any chunks after it
        chunks[whole, rest:].zero_()
        chunks[whole + 1 :].zero_()
