"""flame.compat.fla.chunk_totals_read_on_host: fla's chunk offsets of the active batch's documents carry their total
from the host's copy of ``cu_seqlens``, the same number fla would read from the GPU. (Whole chunk_gla passes with
it, forward and backward, under Triton's interpreter: tests/scripts/mamba2_interpreted.py.)"""

import random

import pytest
import torch

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.compat import fla as fla_compat
from flame.models import registry


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_the_offsets_total_comes_from_the_host_and_equals_fla_s(chunk_size):
    registry.import_fla()
    from fla.ops.common import chunk_h

    assert getattr(chunk_h.prepare_chunk_offsets, "reads_host_total", False)  # applied with fla's import
    lengths = [random.Random(seed).randint(1, 300) for seed in range(40)]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    plain = chunk_h.prepare_chunk_offsets(cu_seqlens, chunk_size)  # outside a batch: fla's own tensor
    assert type(plain) is torch.Tensor
    with batch_context.computing(BatchContext(cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens.tolist())):
        offsets = chunk_h.prepare_chunk_offsets(cu_seqlens, chunk_size)
        other = chunk_h.prepare_chunk_offsets(cu_seqlens.clone(), chunk_size)  # not the batch's tensor
    assert isinstance(offsets, fla_compat.ChunkOffsets) and type(other) is torch.Tensor
    last = offsets[-1]
    assert last.device.type == "cpu" and last.item() == plain[-1].item() == sum(-(-n // chunk_size) for n in lengths)
    torch.testing.assert_close(offsets.as_subclass(torch.Tensor), plain, rtol=0, atol=0)
    assert type(offsets[1:4]) is torch.Tensor and type(offsets + 1) is torch.Tensor  # any other use: the tensor's
    assert offsets.data_ptr() == plain.data_ptr()  # the kernels get fla's own offsets
