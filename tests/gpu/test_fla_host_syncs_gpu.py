"""On a GPU: inside a batch whose host kept its ``cu_seqlens`` (flame.base.batch_context), fla's gla layer runs its
forward and backward without reading the chunk count from the GPU (flame.compat.fla.chunk_totals_read_on_host):
fewer host waits than the same pass outside one, and the same output."""

import warnings

import pytest
import torch

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.registry import import_fla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a GPU")


def _pass(layer, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(output, host waits) of one forward and backward, the waits counted by torch's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = layer(hidden, cu_seqlens=cu_seqlens)[0]
            out.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out.detach(), sum("synchroniz" in str(warning.message) for warning in caught)


def test_the_gla_layer_s_chunk_passes_wait_less_for_the_gpu_with_the_host_s_cu_seqlens():
    import_fla()
    from fla.layers import GatedLinearAttention

    torch.manual_seed(0)
    layer = GatedLinearAttention(hidden_size=256, num_heads=4, mode="chunk").cuda().to(torch.bfloat16)
    lengths = [300, 17, 1000, 64, 663]
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    hidden = torch.randn(1, sum(lengths), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _pass(layer, hidden, cu_seqlens)  # tuning, and fla's index caches for this cu_seqlens
    plain, plain_waits = _pass(layer, hidden, cu_seqlens)
    with batch_context.computing(BatchContext(cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens.tolist())):
        known, known_waits = _pass(layer, hidden, cu_seqlens)
    print(f"host waits of a gla layer's forward and backward: {plain_waits} reading the chunk count, "
          f"{known_waits} with the host's cu_seqlens")
    assert known_waits <= plain_waits - 3  # the forward's, the backward's recompute's and its gradients' reads
    torch.testing.assert_close(known, plain)
