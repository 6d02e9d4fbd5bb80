"""Under torchrun (2 ranks, gloo): one forward/backward per model config, whole batch vs context parallel.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/cp_parity.py CONFIG[:contiguous] ...

For each config, rank 0 prints ``parity <config> <loss rel err> <worst grad rel err>``: the
summed loss of a packed batch (documents crossing the ranks' parts) and every parameter's
gradient, from the ranks' shards (flame.distributed.context_parallel, inputs as the trainer makes
them, gradients summed over the ranks) against one process computing the whole batch with the
same weights. fla's Triton kernels are swapped for PyTorch equivalents (as in
tp_grad_parity.py; the rotary one here also takes per-sequence offsets), so fla's
``transformer`` runs on CPU too.
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

warnings.simplefilter("ignore")

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.loss import cross_entropy_sum
from flame.distributed.context_parallel import ContextParallel
from flame.models.kernels import attention
from flame.models import load_model_config, model_inputs
from flame.models.inputs import is_fla_model
from tests.scripts.tp_grad_parity import build


def _rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
    assert not interleaved and x.shape[0] == 1 and cu_seqlens is not None
    tokens = torch.arange(x.shape[1])
    piece = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    offsets = seqlen_offsets[piece] if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    positions = tokens - cu_seqlens[piece] + offsets  # position within the document
    cos, sin = (t[positions][None, :, None] for t in (cos, sin))
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def parity(path: str, balanced: bool, mesh) -> tuple[float, float]:
    from fla.modules.rotary import ops as rotary

    config = load_model_config(path)
    for name in ("sliding_window", "window_size"):  # mistral's, fla transformer's
        if hasattr(config, name):
            setattr(config, name, 9)  # windows shorter than the documents
    torch.manual_seed(0)
    model = build(config, fused=False)
    rotary.rotary_embedding = _rotary
    generator = torch.Generator().manual_seed(1)
    rows, length = 3, 32
    ids = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
    labels = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
    labels[0, :5] = -100
    # documents of 3 rows; the ranks' parts (head-tail: 24 tokens; contiguous: 48) end inside documents
    lengths = [3, 25, 4, 10, 15, 7, 20, 12]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
    batch = {
        "input": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).view(rows, length),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(lengths),
    }
    count = (labels != -100).sum()

    def loss_and_grads(batch, labels, layout=None):
        model.zero_grad()
        inputs, targets, kwargs = model_inputs(model, batch, labels)
        context = BatchContext(cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"], context_parallel=layout)
        with batch_context.computing(context):  # as the trainer runs a batch
            loss = cross_entropy_sum(model(inputs, **kwargs).logits, targets) / count
            loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    reference, reference_grads = loss_and_grads(batch, labels)
    context_parallel = ContextParallel(mesh, balanced)
    if is_fla_model(model):
        from flame.distributed.context_parallel import _install_in_fla

        _install_in_fla(model)
    loss, grads = loss_and_grads(*context_parallel.shard(batch, labels))
    dist.all_reduce(loss)
    worst = 0.0
    for name, grad in grads.items():
        dist.all_reduce(grad)
        expected = reference_grads[name]
        worst = max(worst, ((grad - expected).abs().max() / expected.abs().max()).item())
    return (abs(loss - reference) / abs(reference)).item(), worst


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    attention.set_backend("sdpa")
    for spec in sys.argv[1:]:
        path, _, mode = spec.partition(":")
        loss_err, grad_err = parity(path, mode != "contiguous", mesh)
        if dist.get_rank() == 0:
            print(f"parity {spec} {loss_err:.3e} {grad_err:.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
