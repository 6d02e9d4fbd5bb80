"""Under torchrun (2 ranks): one forward/backward per model config, unsharded vs tensor parallel.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/tp_grad_parity.py CONFIG[:fused] ...
    (on 2 GPUs, with fla's kernels: ... tp_grad_parity.py --cuda [--attn-mode fused_recurrent] CONFIG ...)

For each config, rank 0 prints ``parity <config> <loss rel err> <worst grad rel err>`` (and
``worst <config>`` with the three parameters whose gradients differ most): the summed loss of a packed batch and every parameter's gradient, from a model sharded with
flame's plan (inputs from flame.models.inputs, as the trainer makes them) against an
unsharded copy with the same weights. fla's Triton norms and activation are swapped for
PyTorch equivalents in both models (CPU has no Triton driver; torch_kernels.py), so the fla
models whose token mixer is plain PyTorch on CPU run: ``transformer`` (softmax attention through
flame's attention) and ``mamba2`` (flame's PyTorch scan, flame.models.kernels.mamba2). ``gla`` runs too, its
Triton recurrence replaced by the same recurrence written token by token in PyTorch: its plan's
pieces (replicated low-rank gate input, gated output norm) are what this checks, not fla's kernel.
With --cuda (nccl, one GPU per rank) nothing is swapped: fla's kernels run, in fp32. On GPUs
gla's gradient is ill-conditioned (a 1e-7 relative weight change moves the 340M gla's layer-0
q/k gradients as much as TP does; docs/perf-log.md, 2026-11-22), so there it says nothing about
TP; the CPU runs here (tiny configs, whose gradients hold steady at fp32's rounding) do.
"""

import argparse
import contextlib
import types
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

warnings.simplefilter("ignore")

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.loss import build_loss, use_fused_cross_entropy
from flame.distributed.tensor_parallel import apply_tensor_parallel
from flame.models.kernels import attention
from flame.models import load_model_config, model_inputs
from flame.models.builder import _trainable_class
from flame.models.kernels.fused import use_fused_kernels
from tests.scripts.torch_kernels import use_torch_kernels


def build(config, fused: bool, torch_kernels: bool = True) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from flame.models.inputs import is_fla_config

    options = {} if is_fla_config(config) else {"attn_implementation": attention.HF_ATTENTION}
    model = AutoModelForCausalLM.from_config(config, **options)
    model.__class__ = _trainable_class(type(model), None, None)  # no init seed, no LoRA adapters
    if not is_fla_config(config):  # as flame builds HF models (fla's kernels on CUDA)
        use_fused_kernels(model)
    if fused:
        use_fused_cross_entropy(model)
    if torch_kernels:
        use_torch_kernels(model)
    return model


def cpu_batch(vocab_size: int) -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows, length = 2, 32
    ids = torch.randint(0, vocab_size, (rows, length), generator=generator)
    labels = torch.randint(0, vocab_size, (rows, length), generator=generator)
    labels[0, :5] = -100
    lengths = [20, 12, 7, 25]
    batch = {
        "input": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).view(rows, length),
        "cu_seqlens": torch.tensor([0, 20, 32, 39, 64], dtype=torch.int32),
        "max_seqlen": 25,
    }
    return batch, labels


def packed_batch(vocab_size: int, rows: int = 2, length: int = 4096, longest: int = 512,
                 device: str = "cuda") -> tuple[dict, torch.Tensor]:
    """Rows packed with random documents of 1-``longest`` tokens. The defaults are --cuda's batch: at context
    512, 340M gla's step-1 gradient norms under TP 2 x FSDP 2 and FSDP 2 differed 3.7x with equal losses
    (docs/perf-log.md, 2026-11-22)."""
    generator = torch.Generator().manual_seed(1)
    lengths = []
    for _ in range(rows):
        left = length
        while left:
            lengths.append(min(left, int(torch.randint(1, longest + 1, (1,), generator=generator))))
            left -= lengths[-1]
    ids, labels = (torch.randint(0, vocab_size, (rows, length), generator=generator).to(device) for _ in range(2))
    batch = {
        "input": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).view(rows, length).to(device),
        "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device),
        "max_seqlen": max(lengths),
    }
    return batch, labels


def parity(path: str, fused: bool, mesh, cuda: bool = False, attn_mode: str | None = None) -> tuple[float, dict]:
    """The relative loss difference, and each parameter's largest gradient difference relative to its largest gradient."""
    config = load_model_config(path)
    if attn_mode:
        config.attn_mode = attn_mode
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    reference = build(config, fused, torch_kernels=not cuda).to(device)
    with torch.device("meta"):
        sharded = build(config, fused, torch_kernels=not cuda)
    job = types.SimpleNamespace(
        parallelism=types.SimpleNamespace(disable_loss_parallel=False, enable_async_tensor_parallel=False),
        compile=types.SimpleNamespace(enable=False, components=[]),
        training=types.SimpleNamespace(z_loss=0.0, logit_softcap=0.0),
        model=types.SimpleNamespace(config=path),
    )
    apply_tensor_parallel(sharded, mesh, job)
    sharded.to_empty(device=device)
    set_model_state_dict(sharded, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    for name, buffer in reference.named_buffers():
        sharded.get_buffer(name).copy_(buffer)

    batch, labels = packed_batch(config.vocab_size) if cuda else cpu_batch(config.vocab_size)
    loss_fn = build_loss(job)
    losses = []
    for model, context in ((reference, contextlib.nullcontext()), (sharded, loss_parallel())):
        inputs, targets, kwargs = model_inputs(model, batch, labels)
        # as the trainer runs a batch: a fused loss head finds its targets in the batch's context
        with context, batch_context.computing(BatchContext(targets=targets if fused else None)):
            loss = loss_fn(model(inputs, **kwargs), targets)
            loss.backward()
        losses.append(loss.item())
    errors = {}
    sharded_params = dict(sharded.named_parameters())
    for name, param in reference.named_parameters():
        grad = sharded_params[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        errors[name] = ((grad - param.grad).abs().max() / param.grad.abs().max()).item()
    return abs(losses[1] - losses[0]) / abs(losses[0]), errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("specs", nargs="+", help="CONFIG or CONFIG:fused")
    parser.add_argument("--cuda", action="store_true",
                        help="on GPUs (nccl) with fla's own kernels, 2 rows of 4096 tokens of short documents")
    parser.add_argument("--attn-mode", help="an fla config's attn_mode (e.g. fused_recurrent)")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    if args.cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh("cuda" if args.cuda else "cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    for spec in args.specs:
        path, _, mode = spec.partition(":")
        loss_err, grad_errors = parity(path, mode == "fused", mesh, args.cuda, args.attn_mode)
        if dist.get_rank() == 0:
            print(f"parity {spec} {loss_err:.3e} {max(grad_errors.values()):.3e}", flush=True)
            worst = sorted(grad_errors.items(), key=lambda item: -item[1])[:3]
            print(f"worst {spec} " + " ".join(f"{name}={error:.1e}" for name, error in worst), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
